"""Grouped expert GEMM for the MoE layers on CUDA: one Triton launch per projection per layer over
the (token, expert) pairs sorted by expert, with no host synchronisation (so a sparse layer can
be captured in a CUDA graph like a dense one).

:func:`block_plan` sorts the pairs by expert and pads each expert's run to a multiple of
``BLOCK_M`` rows: every row block then belongs to one expert (``block_expert``), and a block's
program multiplies its gathered activation rows with that expert's weight tile. The number of
blocks is bounded from the pair count alone (``pairs + min(E, pairs) * (BLOCK_M - 1)`` rows), so
the grid size never depends on the routing; blocks past the last used one, and padding rows,
do nothing. An expert with no pairs gets no block.

``gate_up`` reads activation row ``pair // top_k`` (the token of the pair) and writes pair rows;
``down`` reads pair rows, scales each by its routing weight and writes pair rows, summed over
each token's ``top_k`` pairs afterwards. fp32 uses IEEE dot products. Tested on CPU tensors under
``TRITON_INTERPRET=1`` (``tests/test_engine_moe_triton.py``); used on CUDA only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from laneserve.engine.models.moe_types import MoEWeights, Routed

# the interpreter computes bf16 dot products wrongly (numpy has no bf16): there, tiles widen to fp32
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["N", "K", "num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, scale_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    A_DIV: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    a_row = pair // A_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SCALE:
        scale = tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@dataclass(slots=True)
class BlockPlan:
    """The pairs sorted by expert, padded per expert to whole row blocks."""

    sorted_pairs: torch.Tensor    # [blocks * block_m] int32 pair index, ``num_pairs`` for padding
    block_expert: torch.Tensor    # [blocks] int32 expert of each row block, -1 when unused
    num_pairs: int
    block_m: int


def block_plan(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> BlockPlan:
    """Sort the ``[T, k]`` expert ids' pairs by expert (device ops only, no host sync)."""
    flat = ids.flatten()
    pairs = flat.numel()
    if block_m is None:
        block_m = 16 if pairs <= 64 * num_experts else 64
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start, start = pad_end - padded, torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)
    dest = pad_start.index_select(0, expert) + torch.arange(pairs, device=flat.device) - start.index_select(0, expert)
    blocks = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.index_copy_(0, dest, order.to(torch.int32))
    first_row = torch.arange(blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(pad_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockPlan(sorted_pairs, block_expert, pairs, block_m)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, plan: BlockPlan, a_rows_per_token: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a[p // a_rows_per_token] @ w[expert(p)].T`` (times ``scale[p]``) for every pair ``p``:
    ``[num_pairs, w.shape[1]]`` in ``a``'s dtype."""
    if a.dtype != w.dtype:
        raise ValueError(f"activations ({a.dtype}) and expert weights ({w.dtype}) differ in dtype")
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(plan.num_pairs, n, dtype=a.dtype, device=a.device)
    if plan.num_pairs == 0:
        return out
    a = a.contiguous()
    block_n, block_k = 64, 32 if _INTERPRETED else 64
    grid = (plan.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, plan.sorted_pairs, plan.block_expert, scale if scale is not None else out,
        n, k, plan.num_pairs, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_DIV=a_rows_per_token, SCALE=scale is not None, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, IEEE=a.dtype == torch.float32, UPCAST=_INTERPRETED and a.dtype == torch.bfloat16)
    return out


def fused_gate_up(x: torch.Tensor, moe: MoEWeights, weights: torch.Tensor, ids: torch.Tensor,
                  block_m: int | None = None) -> Routed:
    plan = block_plan(ids, moe.num_experts, block_m)
    gate, up = grouped_gemm(x, moe.gate_up, plan, a_rows_per_token=moe.top_k).chunk(2, dim=-1)
    return Routed(F.silu(gate) * up, weights, ids, plan=plan)


def fused_down(routed: Routed, moe: MoEWeights) -> torch.Tensor:
    t, k = routed.ids.shape
    out = grouped_gemm(routed.act, moe.down, routed.plan, a_rows_per_token=1,
                       scale=routed.weights.flatten().contiguous())
    return out.view(t, k, -1).sum(dim=1)
