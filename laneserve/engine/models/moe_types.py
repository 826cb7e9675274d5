"""The value types of a sparse (mixture-of-experts) layer, apart from the code that runs them, so
the CPU path (``models/moe.py``) and the CUDA kernel (``engine/moe_triton.py``) both import them
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MoEWeights:
    """One sparse layer: the router and the stacked expert weights."""

    router: torch.Tensor          # [E, hidden]
    gate_up: torch.Tensor         # [E, 2 * inter, hidden]: the gate rows, then the up rows
    down: torch.Tensor            # [E, hidden, inter]
    top_k: int
    renormalize: bool

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]

    def shard(self, rank: int, world: int) -> MoEWeights:
        """This rank's slice of every expert's intermediate dimension (router replicated)."""
        inter = self.intermediate
        if inter % world:
            raise ValueError(f"expert intermediate size {inter} is not divisible by {world} ranks")
        part = inter // world
        lo, hi = rank * part, (rank + 1) * part
        gate_up = torch.cat([self.gate_up[:, lo:hi], self.gate_up[:, inter + lo:inter + hi]], dim=1)
        return MoEWeights(self.router, gate_up.contiguous(), self.down[:, :, lo:hi].contiguous(),
                          self.top_k, self.renormalize)


@dataclass(slots=True)
class Routed:
    """What ``gate_up`` hands to ``down``: the activations of the (token, expert) pairs and how to
    combine them (``order`` and ``counts`` on the sorted CPU path, the kernel's block plan on CUDA)."""

    act: torch.Tensor             # [T * k, inter]
    weights: torch.Tensor         # [T, k] routing weights (activation dtype)
    ids: torch.Tensor             # [T, k] chosen experts
    order: torch.Tensor | None = None      # pair index of each sorted row (CPU path)
    counts: list[int] | None = None        # rows per expert (CPU path)
    plan: object | None = None             # moe_triton.BlockPlan (CUDA path)
