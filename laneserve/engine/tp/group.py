"""Joining a rank group: the private store, the process groups and the agreed KV size.

Every rank calls :func:`join` with the same :class:`GroupSpec`. The store is a file in a folder
private to the instance (no port to pick, so several instances on one host never collide). On
CUDA the model's collectives use NCCL and a second, gloo group carries the CPU control traffic
(the stop agreement, the KV agreement); on CPU one gloo group does both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from laneserve.engine.config import EngineConfig
from laneserve.engine.tp.channel import pid_alive
from laneserve.engine.tp.comm import Communicator, make_group

#: the CPU cap on KV tokens the offline API applies to itself (see engine/llm.py)
CPU_KV_TOKENS_CAP = 1 << 17


@dataclass(frozen=True)
class GroupSpec:
    model_path: str
    world: int
    config: EngineConfig
    store_path: str
    timeout_s: float = 300.0
    #: the shared-memory stop board (``stop_protocol.StopBoard``); None: a broadcast per boundary
    stop_board: str | None = None
    #: each rank sees only its own GPU (Ray gives every rank actor one): every rank takes ``cuda:0``
    one_gpu_per_rank: bool = False


@dataclass
class Joined:
    comm: Communicator
    control: object          # CPU process group
    device: torch.device


def rank_device(config: EngineConfig, rank: int, one_gpu_per_rank: bool = False) -> torch.device:
    """Rank ``rank``'s device: on CUDA the instance's device is its first GPU and rank r takes the
    r-th one after it (``cuda:2`` at TP2: ranks on GPUs 2 and 3), so instances given their first
    GPU each in ``--devices`` never share one; a rank that sees only its own GPU takes ``cuda:0``."""
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", 0 if one_gpu_per_rank else (dev.index or 0) + rank)
    return dev


def join(spec: GroupSpec, rank: int) -> Joined:
    device = rank_device(spec.config, rank, spec.one_gpu_per_rank)
    store = dist.FileStore(spec.store_path, spec.world)
    store.set_timeout(_td(spec.timeout_s))
    if device.type == "cuda":  # pragma: no cover - needs GPUs
        torch.cuda.set_device(device)
        main = make_group(dist.PrefixStore("nccl", store), rank, spec.world, device, spec.timeout_s)
        control = make_group(dist.PrefixStore("gloo", store), rank, spec.world, torch.device("cpu"), spec.timeout_s)
    else:
        main = control = make_group(store, rank, spec.world, device, spec.timeout_s)
    return Joined(Communicator(main, rank, spec.world), control, device)


def agree_min(control, value: int) -> int:
    """The minimum of ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    control.allreduce([t], opts).wait()
    return int(t[0])


def gather_to_first(control, t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype everywhere) on rank 0; ``[]`` on the others."""
    rank = control.rank()
    out = [torch.empty_like(t) for _ in range(world)] if rank == 0 else []
    opts = dist.GatherOptions()
    opts.rootRank = 0
    control.gather([out] if rank == 0 else [], [t.contiguous()], opts).wait()
    return out


def scatter_from_first(control, parts: list[torch.Tensor], shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rank 0 sends ``parts[r]`` to rank ``r``; every rank returns its own (``shape``/``dtype``:
    what the others receive)."""
    rank = control.rank()
    out = torch.empty(tuple(shape), dtype=parts[0].dtype if parts else dtype)
    opts = dist.ScatterOptions()
    opts.rootRank = 0
    control.scatter([out], [parts] if rank == 0 else [], opts).wait()
    return out


def barrier(control) -> None:
    control.barrier().wait()


def local_kv_blocks(config: EngineConfig, model) -> int:
    """The KV blocks this rank could hold on its own (its share of the KV heads)."""
    per_token = model.config.kv_bytes_per_token(model.embed.element_size())
    blocks = config.resolve_num_kv_blocks(per_token)
    if config.num_kv_blocks is None and config.device == "cpu":
        blocks = min(blocks, CPU_KV_TOKENS_CAP // config.block_size)
    return blocks


def _td(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def parent_alive(parent_pid: int):
    """A check for the rank loops: False once the process that started this one is gone."""
    return lambda: os.getppid() == parent_pid


def process_alive(pid: int):
    """The same check for a rank that is not rank 0's child (a Ray actor): False once ``pid`` is gone."""
    return lambda: pid_alive(pid)
