"""The sparse MLP of the MoE models (Qwen3-MoE, Mixtral) as the two MLP operators of a layer,
so operator-level preemption and the shape buckets treat a sparse layer like a dense one:

* ``gate_up``  router (softmax over the experts in fp32, top-k, renormalised when the config
  says so), then every (token, chosen expert) pair's gate/up projection and SiLU(gate) * up;
* ``down``     every pair's down projection, scaled by its routing weight and summed per token.

One grouped computation per projection instead of a loop that masks the batch for each expert:
the (token, expert) pairs are sorted by expert so each expert's rows are one contiguous slice.
On CPU each non-empty slice is one GEMM (:func:`sorted_gate_up` / :func:`sorted_down`); on CUDA
the Triton kernel of ``engine/moe_triton.py`` runs each projection as one launch over the sorted
pairs with no host synchronisation (capturable in a CUDA graph). :func:`reference_moe` is the
per-expert loop over all experts, the baseline of the tests and ``benchmarks/moe_step.py``.

Tensor parallelism: the router is replicated; each expert's intermediate dimension splits across
ranks like a dense MLP's (``gate_up[e]`` keeps its gate and up row shards, ``down[e]`` the matching
column shard, see :meth:`MoEWeights.shard`), so each rank's ``down`` output is a partial sum that
goes through the same all-reduce as a dense layer's down projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.engine.models.moe_types import MoEWeights, Routed


def route(x: torch.Tensor, moe: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing weights ``[T, k]`` (dtype of ``x``) and expert ids ``[T, k]``."""
    probs = torch.softmax(F.linear(x, moe.router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def _use_triton(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        import laneserve.engine.moe_triton  # noqa: F401
    except ImportError:
        return False
    return True


def moe_gate_up(x: torch.Tensor, moe: MoEWeights) -> Routed:
    """The ``gate_up`` operator of a sparse layer (``x`` is the normed hidden state)."""
    weights, ids = route(x, moe)
    if _use_triton(x):
        from laneserve.engine.moe_triton import fused_gate_up

        return fused_gate_up(x, moe, weights, ids)
    return sorted_gate_up(x, moe, weights, ids)


def moe_down(routed: Routed, moe: MoEWeights) -> torch.Tensor:
    """The ``down`` operator: ``[T, hidden]``, the weighted sum over each token's experts (a
    partial sum under tensor parallelism)."""
    if routed.plan is not None:
        from laneserve.engine.moe_triton import fused_down

        return fused_down(routed, moe)
    return sorted_down(routed, moe)


def sorted_gate_up(x: torch.Tensor, moe: MoEWeights, weights: torch.Tensor, ids: torch.Tensor) -> Routed:
    """CPU path: sort the pairs by expert, one GEMM per non-empty expert over its contiguous rows
    (written in place into one buffer), then one SiLU(gate) * up over all pairs."""
    k = moe.top_k
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=moe.num_experts).tolist()
    rows = x.index_select(0, order // k)
    gate_up = x.new_empty(order.numel(), 2 * moe.intermediate)
    _grouped_mm(rows, moe.gate_up, counts, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return Routed(F.silu(gate) * up, weights, ids, order=order, counts=counts)


def sorted_down(routed: Routed, moe: MoEWeights) -> torch.Tensor:
    t, k = routed.ids.shape
    act, order = routed.act, routed.order
    ys = act.new_empty(act.shape[0], moe.down.shape[1])
    _grouped_mm(act, moe.down, routed.counts, ys)
    ys.mul_(routed.weights.flatten().index_select(0, order).unsqueeze(1))
    return ys.new_zeros(t, ys.shape[1]).index_add_(0, order // k, ys)


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """``out[rows of e] = a[rows of e] @ w[e].T`` for each expert's contiguous run of rows."""
    start = 0
    for expert, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n], w[expert].t(), out=out[start:start + n])
            start += n


def reference_moe(x: torch.Tensor, moe: MoEWeights,
                  routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Baseline: a loop over all experts, each masking the batch for its tokens (no sorting);
    ``routing`` (weights, ids) replaces the router's choice."""
    weights, ids = routing if routing is not None else route(x, moe)
    out = torch.zeros_like(x)
    for expert in range(moe.num_experts):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], moe.gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


#: checkpoint names of a sparse block: (module, router, gate, up, down) per architecture
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


def moe_from_checkpoint(take, layer_prefix: str, config) -> MoEWeights:
    """The sparse block of one layer from a checkpoint's per-expert tensors (``take(name)`` pops one
    tensor already on the target device and dtype). Experts are stacked into ``[E, ...]`` tensors."""
    module, router, gate, up, down = CHECKPOINT_NAMES[config.architecture]
    m = f"{layer_prefix}{module}."
    gate_up, downs = [], []
    for e in range(config.num_experts):
        x = f"{m}experts.{e}."
        gate_up.append(torch.cat([take(f"{x}{gate}.weight"), take(f"{x}{up}.weight")], dim=0))
        downs.append(take(f"{x}{down}.weight"))
    stacked_gate_up = torch.stack(gate_up)
    del gate_up
    return MoEWeights(router=take(f"{m}{router}.weight"), gate_up=stacked_gate_up, down=torch.stack(downs),
                      top_k=config.experts_per_token, renormalize=config.norm_topk_prob)
