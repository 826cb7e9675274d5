"""Attention that reads the paged KV cache directly: one Triton kernel for decode and for prefill
chunks on top of cached tokens (GQA, block tables, bf16 / fp16 / fp32), registered as the
``"paged"`` attention path and the CUDA default where Triton imports (``EngineConfig``).

The gather paths of ``engine/attention.py`` copy every context a layer needs out of the cache
into a workspace and then call SDPA (with an explicit mask for a chunk over a cached prefix); this
kernel instead walks each sequence's block table and loads its K/V tiles from the cache where they
lie, with an online softmax (FlashAttention's recurrence), so a chunk over a long cached prefix
costs its attention FLOPs and one read of the prefix, not a gather per layer.

Work split: one program per (sequence, KV head, tile of query rows), where the query rows of a
tile are the (token, query head) pairs of that KV head's group, token-major — a decode step's
program holds the group's query heads of its one token, so each K/V tile is loaded once per group
(GQA without expanding K/V). Query token ``i`` of a sequence with ``start`` cached tokens sits at
position ``start + i`` and sees keys ``0 .. start + i`` (causal within the chunk, full over the
prefix); the new K/V are already in the cache when the kernel runs (the model writes them first).

fp32 inputs use IEEE-precision dot products (no TF32), so fp32 results match the SDPA path to
rounding. Correctness is tested on CPU tensors under ``TRITON_INTERPRET=1``
(``tests/test_engine_triton.py``); the kernel is used on CUDA only, the gather paths stay on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from laneserve.engine.attention import AttentionBackend, AttentionBatch, register_attention
from laneserve.engine.device_stream import upload

# Triton's CPU interpreter computes bf16 dot products wrongly (numpy has no bf16): there, and only
# there, bf16 tiles are widened to fp32 before each dot (loads, stores and the rest stay bf16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["num_seqs", "table_width"])     # one compile for every batch size
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, meta_ptr, tables_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    num_seqs, table_width, block_size, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(meta_ptr + seq)
    q_len = tl.load(meta_ptr + num_seqs + seq)
    ctx_len = tl.load(meta_ptr + 2 * num_seqs + seq)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    start = ctx_len - q_len                               # cached tokens before the chunk

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)         # (token, head-in-group) pairs, token-major
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = start + tok                                   # position of each row's token
    last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = tl.minimum(ctx_len, start + last_tok + 1)    # keys any row of the tile may see
    table_row = tables_ptr + seq * table_width
    for n in range(0, kv_end, BLOCK_N):
        k_pos = n + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        block = tl.load(table_row + k_pos // block_size, mask=k_ok, other=0)
        slot = block.to(tl.int64) * block_size + k_pos % block_size
        kv_off = slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that see nothing yet (padding rows)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(slots=True)
class PagedMeta:
    """One step's kernel inputs: ``meta`` int32 ``[3 * S]`` (query row offset, new tokens, context
    length per sequence), ``tables`` int32 ``[S, width]`` (block tables, padded with block 0),
    ``max_q_len`` (host int, sizes the grid)."""

    num_seqs: int
    max_q_len: int
    meta: torch.Tensor
    tables: torch.Tensor


def paged_meta(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
               device: torch.device) -> PagedMeta:
    """Kernel metadata for sequences laid out one after another in the step's token rows, uploaded
    in one copy."""
    s = len(q_lens)
    q_start, row = [], 0
    for n in q_lens:
        q_start.append(row)
        row += n
    used = [-(-c // block_size) for c in ctx_lens]
    for table, u, c in zip(block_tables, used, ctx_lens):
        if u > len(table):
            raise ValueError(f"block table holds {len(table)} blocks, context of {c} tokens needs {u}")
    width = max(max(used, default=1), 1)
    flat = q_start + list(q_lens) + list(ctx_lens)
    for table, u in zip(block_tables, used):
        flat.extend(table[:u])
        flat.extend([0] * (width - u))
    packed = upload(torch.tensor(flat, dtype=torch.int32), device)
    return PagedMeta(s, max(q_lens, default=0), packed[:3 * s], packed[3 * s:].view(s, width))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta,
                    block_size: int, out: torch.Tensor | None = None, block_m: int | None = None,
                    block_n: int | None = None) -> torch.Tensor:
    """``q`` ``[T, heads, d]``; caches ``[slots, kv_heads, d]`` (``PagedKVCache.layer``); returns
    ``[T, heads, d]``. Rows of tokens outside every sequence are left as they are in ``out``."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if meta.num_seqs == 0 or t == 0:
        return out
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged attention needs a unit stride over head_dim and K/V caches of one layout")
    block_d = triton.next_power_of_2(dim)
    if block_m is None:
        block_m = max(16, min(64, triton.next_power_of_2(meta.max_q_len * group)))
    if block_n is None:
        block_n = 64 if block_d <= 64 else 32
    grid = (meta.num_seqs, kv_heads, triton.cdiv(meta.max_q_len * group, block_m))
    scale_log2 = (1.0 / dim ** 0.5) * 1.4426950408889634
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.meta, meta.tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.num_seqs, meta.tables.shape[1], block_size, scale_log2,
        GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, UPCAST=q.dtype == torch.bfloat16 and _INTERPRETED,
    )
    return out


@register_attention
class PagedAttention(AttentionBackend):
    """The ``"paged"`` path: :func:`paged_attention` over the layer's cache (no gather, no
    workspace, no mask tensor). One exception: a step that is a single fresh prompt of at least
    :data:`FRESH_SDPA_MIN` tokens in 16-bit floats on CUDA attends to its own new K/V with causal SDPA
    (FlashAttention under the engine's SDPA kernel choice), the fastest kernel for that shape."""

    name = "paged"

    def prepare(self, batch: AttentionBatch, device: torch.device) -> tuple[PagedMeta, int, bool]:
        fresh = (torch.device(device).type == "cuda" and len(batch.q_lens) == 1 and batch.starts[0] == 0
                 and batch.q_lens[0] >= FRESH_SDPA_MIN)
        meta = paged_meta(batch.q_lens, batch.ctx_lens, batch.block_tables, batch.block_size, device)
        return meta, batch.block_size, fresh

    def forward(self, q, k_new, v_new, k_cache, v_cache, meta: tuple[PagedMeta, int, bool]) -> torch.Tensor:
        paged, block_size, fresh = meta
        if fresh and q.dtype in (torch.bfloat16, torch.float16):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_new.transpose(0, 1)[None],
                                               v_new.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            return o[0].transpose(0, 1)
        return paged_attention(q, k_cache, v_cache, paged, block_size)


#: a single fresh prompt at least this long goes to causal SDPA on CUDA in 16-bit floats
FRESH_SDPA_MIN = 64
