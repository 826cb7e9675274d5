"""The communicator a sharded model calls inside its operators: one all-reduce after each
row-parallel projection (``o_proj``, ``down``) and after the vocab-parallel embedding, and one
gather of the vocab-parallel logits to rank 0, where sampling happens.

Process groups are built from a store private to the instance (``ProcessGroupGloo`` /
``ProcessGroupNCCL`` constructed directly, never ``init_process_group``), so several
tensor-parallel instances can live on one host, or one process, without sharing a default group.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def make_group(store: dist.Store, rank: int, world: int, device: torch.device,
               timeout_s: float = 600.0):
    """A process group of ``world`` ranks on ``device``: NCCL on CUDA, gloo elsewhere."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":      # pragma: no cover - needs GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


class Communicator:
    """Collectives of one rank of a tensor-parallel model."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.all_reduces = 0            # counted: the tests check how many a step makes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks (in place; returns it)."""
        self.all_reduces += 1
        self.group.allreduce([t]).wait()
        return t

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0 gets the full ``[rows, vocab_size]`` logits; the others get their own part back."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else []
        self.group.gather([parts] if self.rank == 0 else [], [local], _gather_opts()).wait()
        if self.rank != 0:
            return local
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def _gather_opts() -> dist.GatherOptions:
    opts = dist.GatherOptions()
    opts.rootRank = 0
    return opts
