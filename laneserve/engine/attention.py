"""Attention over the paged KV cache, two interchangeable paths (docs/design.md, "AlignedServe":
"a padded batch pays for its longest member, a ragged one for the sum").

* ``"padded"``: one batched SDPA call over every sequence of the step, queries padded to the
  longest chunk and contexts padded to the longest context, with a boolean mask — the cost of the
  whole batch follows ``batch_size x longest context``.
* ``"ragged"``: one SDPA call per sequence over exactly its own context — the cost follows the sum
  of context lengths (plus a per-call overhead).

Both handle prefill chunks on top of cached tokens (causal within the chunk, full over the cached
prefix) and decode (one query over the whole context). New K/V are written into the cache by the
runner before attention; each layer then gathers the contexts it needs from the cache into a
preallocated workspace with ``index_select(..., out=)`` (docs/design.md, "Measured facts": fresh allocation is 3–10x
slower). A sequence without cached tokens attends to its fresh K/V directly (no gather).
Backends are selected by name through :data:`ATTENTION_BACKENDS`.

A third, unregistered path, :class:`StaticPaddedAttention`, is the padded path on fixed-shape,
preallocated metadata for the shape buckets of ``engine/graphs.py`` (CUDA graphs on CUDA; the same
static path runs eagerly on CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from laneserve.engine.device_stream import upload, upload_packed

#: the SDPA kernels the engine allows on CUDA, in priority order: FlashAttention, then the
#: memory-efficient kernel (any dtype, any mask); the math kernel only where neither applies. cuDNN
#: attention is never chosen: it builds a plan per new shape, and a step's shapes change every step.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device):
    """The context one layer's attention runs in: SDPA held to :data:`CUDA_SDPA_BACKENDS` on
    CUDA; nothing on other devices."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if _SDPA_PRIORITY:
        return sdpa_kernel(list(CUDA_SDPA_BACKENDS), set_priority=True)
    return sdpa_kernel(list(CUDA_SDPA_BACKENDS))


_SDPA_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters   # torch >= 2.6


@dataclass(slots=True)
class AttentionBatch:
    """The sequences of one step, in the order of the step's flat token rows."""

    q_lens: list[int]            # new tokens per sequence
    starts: list[int]            # cached tokens per sequence (position of its first new token)
    block_tables: list[list[int]]
    block_size: int

    @property
    def ctx_lens(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.q_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class GatherWorkspace:
    """Preallocated K/V gather buffers shared by every layer and step; grown (to the next power of
    two) only when a step needs more rows. Only used *within* one attention call, so a parked
    (preempted) step never holds on to them.

    ``gather`` fills the compact buffers (real context rows only); ``scatter_padded`` places those
    rows into the zero-initialised padded buffers, whose padding rows keep stale but finite values
    that the mask hides — so padding costs attention FLOPs, not gather bandwidth."""

    __slots__ = ("k", "v", "pad_k", "pad_v", "_kv_heads", "_head_dim", "_dtype", "_device")

    def __init__(self, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self._kv_heads, self._head_dim, self._dtype, self._device = kv_heads, head_dim, dtype, device
        self.k, self.v = self._alloc(rows)
        self.pad_k, self.pad_v = self._alloc(0)

    def _alloc(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        cap = 1 << max(rows - 1, 1).bit_length() if rows else 0
        shape = (cap, self._kv_heads, self._head_dim)
        return (torch.zeros(shape, dtype=self._dtype, device=self._device),
                torch.zeros(shape, dtype=self._dtype, device=self._device))

    def take(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rows > self.k.shape[0]:
            self.k, self.v = self._alloc(rows)
        return self.k[:rows], self.v[:rows]

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_out, v_out = self.take(index.shape[0])
        torch.index_select(k_cache, 0, index, out=k_out)
        torch.index_select(v_cache, 0, index, out=v_out)
        return k_out, v_out

    def scatter_padded(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                       total: int) -> tuple[torch.Tensor, torch.Tensor]:
        if total > self.pad_k.shape[0]:
            self.pad_k, self.pad_v = self._alloc(total)
        pad_k, pad_v = self.pad_k[:total], self.pad_v[:total]
        pad_k.index_copy_(0, rows, k)
        pad_v.index_copy_(0, rows, v)
        return pad_k, pad_v


def block_slots(tables: list[list[int]], ctx_lens: list[int], block_size: int,
                seq_of_row: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Flat cache slots of many sequences at once (host tensor, vectorised): by default every
    position ``[0, ctx_lens[i])`` of each sequence ``i`` in turn; with ``seq_of_row`` and
    ``positions`` (one entry per row), the slot of each given (sequence, position)."""
    used = [-(-c // block_size) for c in ctx_lens]
    for table, n, c in zip(tables, used, ctx_lens):
        if n > len(table):
            raise ValueError(f"block table holds {len(table)} blocks, context of {c} tokens needs {n}")
    width = max(used, default=0)
    grid = torch.tensor([t[:n] + [0] * (width - n) for t, n in zip(tables, used)], dtype=torch.long)
    if seq_of_row is None:
        lens = torch.tensor(ctx_lens, dtype=torch.long)
        seq_of_row = torch.repeat_interleave(torch.arange(len(ctx_lens)), lens)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(seq_of_row.shape[0]) - starts[seq_of_row]
    if seq_of_row.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    return grid[seq_of_row, positions // block_size] * block_size + positions % block_size


class AttentionBackend:
    """``prepare`` builds per-step metadata once; ``forward`` runs one layer's attention.

    ``forward(q, k_new, v_new, k_cache, v_cache, meta)``: q ``[T, heads, d]``, new K/V
    ``[T, kv_heads, d]`` (already written to the cache), caches flattened to
    ``[num_blocks * block_size, kv_heads, d]``; returns ``[T, heads, d]``.
    """

    name: ClassVar[str] = ""

    def __init__(self, workspace: GatherWorkspace) -> None:
        self.workspace = workspace

    def prepare(self, batch: AttentionBatch, device: torch.device) -> Any:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        raise NotImplementedError


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Backends in modules of their own, registered when that module is first imported (named, not
# imported here: the backend module imports this one for the base class and the registry).
_OPTIONAL_BACKENDS = {"paged": "laneserve.engine.triton_attention"}     # needs Triton


def register_attention(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def make_attention(name: str, workspace: GatherWorkspace) -> AttentionBackend:
    if name in _OPTIONAL_BACKENDS and name not in ATTENTION_BACKENDS:
        importlib.import_module(_OPTIONAL_BACKENDS[name])
    try:
        return ATTENTION_BACKENDS[name](workspace)
    except KeyError:
        raise ValueError(f"unknown attention path {name!r}; registered: {sorted(ATTENTION_BACKENDS)}") from None


def _chunk_mask(start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, start + n]``: query i (position start+i) sees keys 0..start+i. Built where it is used
    (no host-to-device copy)."""
    return torch.arange(start + n, device=device)[None, :] <= (start + torch.arange(n, device=device))[:, None]


# ---- ragged: one SDPA per sequence ------------------------------------------------------------
@dataclass(slots=True)
class _RaggedSeq:
    q_offset: int
    q_len: int
    k_offset: int          # row in the gather buffer, -1 = attend to the fresh K/V
    ctx_len: int
    mask: torch.Tensor | None
    causal: bool


@dataclass(slots=True)
class _RaggedMeta:
    seqs: list[_RaggedSeq]
    gather_index: torch.Tensor | None


@register_attention
class RaggedAttention(AttentionBackend):
    name = "ragged"

    def prepare(self, batch: AttentionBatch, device: torch.device) -> _RaggedMeta:
        seqs = []
        gather_tables, gather_lens = [], []
        q_off = k_off = 0
        for n, start, table in zip(batch.q_lens, batch.starts, batch.block_tables):
            ctx = start + n
            if start == 0:
                seqs.append(_RaggedSeq(q_off, n, -1, ctx, None, n > 1))
            else:
                mask = None if n == 1 else _chunk_mask(start, n, device)
                seqs.append(_RaggedSeq(q_off, n, k_off, ctx, mask, False))
                gather_tables.append(table)
                gather_lens.append(ctx)
                k_off += ctx
            q_off += n
        index = upload(block_slots(gather_tables, gather_lens, batch.block_size), device) if gather_tables else None
        return _RaggedMeta(seqs, index)

    def forward(self, q, k_new, v_new, k_cache, v_cache, meta: _RaggedMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        kv_heads, dim = k_new.shape[1], q.shape[2]
        if meta.gather_index is not None:
            k_ctx, v_ctx = self.workspace.gather(k_cache, v_cache, meta.gather_index)
        for s in meta.seqs:
            q_end = s.q_offset + s.q_len
            if s.k_offset < 0:
                k, v = k_new[s.q_offset:q_end], v_new[s.q_offset:q_end]
            else:
                k, v = k_ctx[s.k_offset:s.k_offset + s.ctx_len], v_ctx[s.k_offset:s.k_offset + s.ctx_len]
            if s.q_len == 1:   # decode: fold the query heads onto their KV head (no K/V expansion)
                o = F.scaled_dot_product_attention(
                    q[s.q_offset].view(1, kv_heads, -1, dim), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0))
                out[s.q_offset] = o.reshape(-1, dim)   # CUDA's SDPA may return a non-contiguous output
                continue
            o = F.scaled_dot_product_attention(
                q[s.q_offset:q_end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), attn_mask=s.mask, is_causal=s.causal, enable_gqa=True)
            out[s.q_offset:q_end] = o[0].transpose(0, 1)
        return out


def _padded_rows(lens: list[int], pad: int) -> torch.Tensor:
    """Row of each real entry in a ``[len(lens) * pad]`` padded layout (host, vectorised)."""
    lens_t = torch.tensor(lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    first = torch.cumsum(lens_t, 0) - lens_t
    return torch.arange(seq.shape[0]) - first[seq] + seq * pad


# ---- padded: one batched SDPA over the longest context ---------------------------------------
@dataclass(slots=True)
class _PaddedMeta:
    batch: int
    q_pad: int
    k_pad: int
    q_rows: torch.Tensor | None      # row of each real query in the padded [B * q_pad] layout
    gather_index: torch.Tensor | None   # cache slots of every real context row; None = use the fresh K/V
    k_rows: torch.Tensor | None      # row of each gathered context row in the padded [B * k_pad] layout
    mask: torch.Tensor | None        # [B, 1, q_pad, k_pad]
    causal: bool


@register_attention
class PaddedAttention(AttentionBackend):
    name = "padded"

    def prepare(self, batch: AttentionBatch, device: torch.device) -> _PaddedMeta:
        q_lens, starts = batch.q_lens, batch.starts
        ctx_lens = batch.ctx_lens
        b, q_pad, k_pad = len(q_lens), max(q_lens), max(ctx_lens)
        if b == 1 and starts[0] == 0:   # a single fresh prefill: plain causal attention
            return _PaddedMeta(1, q_pad, k_pad, None, None, None, None, q_pad > 1)
        index = block_slots(batch.block_tables, ctx_lens, batch.block_size)
        hosts = [index]
        ragged_q = any(n != q_pad for n in q_lens)
        ragged_k = any(c != k_pad for c in ctx_lens)
        if ragged_q:
            hosts.append(_padded_rows(q_lens, q_pad))
        if ragged_k:
            hosts.append(_padded_rows(ctx_lens, k_pad))
        hosts.append(torch.tensor(starts + q_lens, dtype=torch.long))
        up = upload_packed(hosts, device)              # one copy for every index vector
        index_d = up[0]
        q_rows = up[1] if ragged_q else None
        k_rows = up[-2] if ragged_k else None
        start_t, q_len_t = up[-1][:b, None, None], up[-1][b:, None, None]
        qi = torch.arange(q_pad, device=device)[None, :, None]
        kj = torch.arange(k_pad, device=device)[None, None, :]
        mask = (kj <= start_t + qi) | ((qi >= q_len_t) & (kj == 0))   # padded query rows see key 0
        return _PaddedMeta(b, q_pad, k_pad, q_rows, index_d, k_rows, mask.unsqueeze(1), False)

    def forward(self, q, k_new, v_new, k_cache, v_cache, meta: _PaddedMeta) -> torch.Tensor:
        b, q_pad, k_pad = meta.batch, meta.q_pad, meta.k_pad
        heads, dim = q.shape[1], q.shape[2]
        if meta.q_rows is None:
            qp = q.view(b, q_pad, heads, dim)
        else:
            qp = q.new_zeros(b * q_pad, heads, dim).index_copy_(0, meta.q_rows, q).view(b, q_pad, heads, dim)
        if meta.gather_index is None:
            k, v = k_new.view(1, k_pad, *k_new.shape[1:]), v_new.view(1, k_pad, *v_new.shape[1:])
        else:
            k, v = self.workspace.gather(k_cache, v_cache, meta.gather_index)
            if meta.k_rows is not None:
                k, v = self.workspace.scatter_padded(k, v, meta.k_rows, b * k_pad)
            k, v = k.view(b, k_pad, *k.shape[1:]), v.view(b, k_pad, *v.shape[1:])
        if q_pad == 1:   # decode batch: fold the query heads onto their KV head (no K/V expansion)
            kv_heads = k.shape[2]
            o = F.scaled_dot_product_attention(qp.view(b, kv_heads, heads // kv_heads, dim), k.transpose(1, 2),
                                               v.transpose(1, 2), attn_mask=meta.mask)
            o = o.reshape(b, heads, dim)
        else:
            o = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=meta.mask, is_causal=meta.causal, enable_gqa=True)
            o = o.transpose(1, 2).reshape(b * q_pad, heads, dim)
        return o if meta.q_rows is None else o.index_select(0, meta.q_rows)


# ---- static: fixed-shape padded attention for shape buckets / CUDA graphs ----------------------
@dataclass(slots=True)
class StaticAttentionMeta:
    """Metadata of one shape bucket (``engine/graphs.py``): every tensor is preallocated once per
    bucket and refilled in place before each run, so the same kernels with the same shapes and
    addresses run every time (what a captured CUDA graph replays).

    Decode bucket ``(B, C)``: ``q_len = 1``, ``k_len = C``; ``gather_index`` ``[B * C]`` holds the
    cache slots of each row's context, padding columns pointing at the scratch slot; the gathered
    K/V land in ``k_buf``/``v_buf`` ``[B * C, kv_heads, d]``. Prefill bucket ``(L, B)`` (fresh
    prompts only): ``q_len = k_len = L``, ``gather_index = None`` (attends to its fresh K/V).
    ``mask`` ``[B, 1, q_len, k_len]``: True where a query may look; every row sees at least key 0,
    so padding rows stay finite."""

    batch: int
    q_len: int
    k_len: int
    mask: torch.Tensor
    gather_index: torch.Tensor | None = None
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


class StaticPaddedAttention(AttentionBackend):
    """The padded path on :class:`StaticAttentionMeta`: capture-safe (no host syncs, no
    allocation whose size depends on data, no Python branch on tensor values). Not in the registry:
    only the bucket runner builds its metadata, so :meth:`prepare` is not available."""

    name = "static"

    def __init__(self, workspace: GatherWorkspace | None = None) -> None:
        self.workspace = workspace

    def prepare(self, batch: AttentionBatch, device: torch.device) -> StaticAttentionMeta:
        raise NotImplementedError("static attention metadata is filled by the bucket runner (engine/graphs.py)")

    def forward(self, q, k_new, v_new, k_cache, v_cache, meta: StaticAttentionMeta) -> torch.Tensor:
        b, q_len, k_len = meta.batch, meta.q_len, meta.k_len
        heads, dim = q.shape[1], q.shape[2]
        if meta.gather_index is None:
            k = k_new.reshape(b, k_len, *k_new.shape[1:])
            v = v_new.reshape(b, k_len, *v_new.shape[1:])
        else:
            torch.index_select(k_cache, 0, meta.gather_index, out=meta.k_buf)
            torch.index_select(v_cache, 0, meta.gather_index, out=meta.v_buf)
            k = meta.k_buf.view(b, k_len, *meta.k_buf.shape[1:])
            v = meta.v_buf.view(b, k_len, *meta.v_buf.shape[1:])
        if q_len == 1:   # decode: fold the query heads onto their KV head (as the padded path does)
            kv_heads = k.shape[2]
            o = F.scaled_dot_product_attention(q.view(b, kv_heads, heads // kv_heads, dim), k.transpose(1, 2),
                                               v.transpose(1, 2), attn_mask=meta.mask)
            return o.reshape(b, heads, dim)
        o = F.scaled_dot_product_attention(q.view(b, q_len, heads, dim).transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=meta.mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * q_len, heads, dim)
