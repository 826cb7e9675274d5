"""Rank 0 of a tensor-parallel instance: :class:`TPExecutor` has the ``EngineExecutor`` interface
(``execute(plan, should_stop)``, ``discard``, ``copy_block``), so the instance runtime and the
scheduler above it never see the ranks.

Rank 0 lives in the instance's own process and holds shard 0 of the model; :class:`RankGroup`
spawns ranks 1..N-1 (spawn context: no fork after torch or CUDA initialisation), joins them in a
private process group and agrees with them on the KV block count (the minimum). Each step it
publishes one :class:`~laneserve.engine.tp.step_message.StepMessage` (a diff) on the shared-memory
channel, then runs its own shard of the forward; sampling happens here only, on the gathered
logits. :meth:`TPExecutor.close` (also run when the executor is collected or the process exits)
tells the ranks to stop, joins them and kills any that do not; the channel's name is removed
once every rank has mapped it, so no shared memory outlives the group.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

import logging

from laneserve.core.kv import BlockCopy, KVCacheManager
from laneserve.core.plan import StepPlan
from laneserve.engine.config import EngineConfig
from laneserve.engine.executor import EngineExecutor, EngineStepResult
from laneserve.engine.runner import plan_sequences, prompt_logprob_rows
from laneserve.engine.tp.channel import StepChannel, sweep_stale
from laneserve.engine.kv_cache import KVPayload
from laneserve.engine.tp.group import (GroupSpec, agree_min, barrier, gather_to_first, join, local_kv_blocks,
                                       scatter_from_first)
from laneserve.engine.tp.kv_reshard import ShardedKVPayload, kv_for_rank
from laneserve.engine.tp.layout import TensorParallelError, check_degree
from laneserve.engine.tp.loader import load_shard
from laneserve.engine.tp.step_message import StepEncoder
from laneserve.engine.tp.stop_protocol import StopBoard, StopProtocol
from laneserve.engine.tp.worker import rank_main

log = logging.getLogger(__name__)

#: how often rank 0 looks at its rank processes while it waits for them to join
JOIN_POLL_S = 0.1
#: how long a failed step waits to see whether a rank process exited (then it is a lost rank)
RANK_EXIT_WAIT_S = 2.0
#: how long to wait for a rank's process to be reaped once a collective said its peer closed the
#: connection: that peer is certainly exiting, but on a loaded host its interpreter teardown can take
#: seconds (the wait ends as soon as the process is gone)
PEER_CLOSED_WAIT_S = 30.0


def _exit_wait_s(exc: BaseException) -> float:
    """How long to wait to see a rank gone after ``exc``: long when the error says a peer closed."""
    text = str(exc).lower()
    return PEER_CLOSED_WAIT_S if "closed by peer" in text or "connection reset" in text else RANK_EXIT_WAIT_S


class RankLost(RuntimeError):
    """A rank process of the group exited: the group cannot run another step (rank 0 holds only its
    own shard), so the instance goes down as a whole."""


def tp_config(config: EngineConfig) -> EngineConfig:
    """The config every rank runs with, refusing what the group cannot do yet."""
    if config.num_host_blocks:
        raise TensorParallelError("a host KV pool (num_host_blocks) is not supported with tensor_parallel_size > 1")
    if config.cuda_graphs:
        log.info("tensor parallelism runs eager steps: cuda_graphs turned off")
    return dataclasses.replace(config, cuda_graphs=False)


class RankGroup:
    """Ranks 1..N-1 as processes, and rank 0's membership (in this process). ``launch="thread"``
    runs ranks 1..N-1 as threads of this process instead (the same code; tests count every rank's
    host work that way); ``launch="ray"`` as Ray actors in the bundles of the placement group this
    process (the instance actor, rank 0) runs in (``ray_ranks``)."""

    def __init__(self, model_path: str | Path, world: int, config: EngineConfig, timeout_s: float = 300.0,
                 launch: str = "process") -> None:
        from laneserve.engine.models.config import ModelConfig

        check_degree(ModelConfig.from_folder(Path(model_path)), world)
        self.world = world
        sweep_stale()                          # files of a group whose rank 0 was killed while starting
        self._dir = tempfile.mkdtemp(prefix="laneserve-tp-")
        self.spec = GroupSpec(str(model_path), world, config, os.path.join(self._dir, "store"), timeout_s)
        self.board = StopBoard.create(world)
        self.spec = dataclasses.replace(self.spec, stop_board=self.board.name,
                                        one_gpu_per_rank=launch == "ray")   # Ray gives each rank its GPU
        ctx = mp.get_context("spawn")
        self.channel = StepChannel.create(ctx, world - 1)
        make, parent, watch = _launcher(ctx, launch)
        self.procs = [make(target=rank_main, args=(self.spec, r, self.channel.handle(r - 1), parent, *watch),
                           name=f"laneserve-tp-rank{r}", daemon=True) for r in range(1, world)]
        self._closed = False
        try:
            for p in self.procs:
                p.start()
            self.joined = self._join()
            self.channel.unlink()          # every rank mapped it before joining the group
            self.stop = StopProtocol(self.board, 0)
            barrier(self.joined.control)   # every rank attached to the board
            os.unlink(self.board.name)
        except BaseException as exc:
            lost = self.wait_lost(_exit_wait_s(exc)) if type(exc) is not RankLost and isinstance(exc, Exception) else ""
            self.close()
            if lost:
                raise RankLost(f"tensor-parallel group failed to start: {lost}") from exc
            raise

    def _join(self):
        """Rank 0's :func:`join`, given up as soon as a rank process exits (a rank that dies before
        it registers would otherwise keep rank 0 waiting for the store's whole timeout)."""
        done: list = []

        def run() -> None:
            try:
                done.append(join(self.spec, 0))
            except BaseException as exc:   # noqa: BLE001 - re-raised in the caller's thread
                done.append(exc)
        t = threading.Thread(target=run, name="laneserve-tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(JOIN_POLL_S)
            if t.is_alive() and not self.alive():
                raise RankLost(f"tensor-parallel group failed to start: {self.lost()}")
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def lost(self) -> str:
        """The ranks that exited, in words (empty while every rank runs)."""
        return ", ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" if hasattr(p, "exitcode")
                         else f"rank {r} (thread) stopped"
                         for r, p in enumerate(self.procs, start=1) if p.ident is not None and not p.is_alive())

    def wait_lost(self, wait_s: float) -> str:
        """:meth:`lost`, after waiting up to ``wait_s`` for a rank to be seen gone: a collective
        fails as soon as a peer's sockets close, a moment before its process can be reaped."""
        deadline = time.monotonic() + wait_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.lost()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if getattr(p, "pid", None) is not None]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def publish(self, message: object) -> int:
        return self.channel.publish(message, self.alive)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (politely, then by force) and remove the channel and the store."""
        if self._closed:
            return
        self._closed = True
        grace = timeout_s
        try:
            if self.procs and self.alive():
                self.channel.publish(("shutdown",), self.alive)
            elif self.lost():          # the others may wait in a collective with the dead rank: no grace
                grace = 0.0
        except Exception:
            pass
        for p in self.procs:
            if p.ident is not None:
                p.join(grace)
                if p.is_alive() and hasattr(p, "kill"):
                    p.kill()
                    p.join(timeout_s)
        self.channel.close()
        self.board.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _launcher(ctx, launch: str):
    """(what starts a rank, the pid its loop watches, how: ``()`` its parent, ``("pid",)`` that
    pid) for ``launch``: a spawned process watches its parent; a Ray actor (whose parent is Ray's)
    watches rank 0's pid."""
    if launch == "process":
        return ctx.Process, os.getpid(), ()
    if launch == "thread":
        return threading.Thread, os.getppid(), ()
    if launch == "ray":
        from laneserve.engine.tp.ray_ranks import RayRank
        return RayRank, os.getpid(), ("pid",)
    raise ValueError(f"launch must be 'process', 'thread' or 'ray', got {launch!r}")


class TPExecutor(EngineExecutor):
    """``EngineExecutor`` over a rank group (rank 0's shard is this executor's model)."""

    def __init__(self, group: RankGroup, model, kv: KVCacheManager, config: EngineConfig) -> None:
        super().__init__(model, kv, config, None)
        self.group = group
        self.stop = group.stop
        self.encoder = StepEncoder()
        from laneserve.engine.models.config import ModelConfig
        self.full_num_kv_heads = ModelConfig.from_folder(Path(group.spec.model_path)).num_kv_heads
        self._finalizer = weakref.finalize(self, group.close)

    @classmethod
    def start(cls, path: str | Path, world: int, config: EngineConfig, kv_factory=None,
              launch: str = "process") -> TPExecutor:
        """Spawn the group, load rank 0's shard, agree on the KV blocks and build the executor;
        ``kv_factory(num_blocks)`` makes the KV manager (default: a plain ``KVCacheManager``)."""
        config = tp_config(config)
        group = RankGroup(path, world, config, launch=launch)
        try:
            model = load_shard(path, 0, world, group.joined.device, config.dtype, group.joined.comm,
                               load_tokenizer_too=True)
            blocks = agree_min(group.joined.control, local_kv_blocks(config, model))
            kv = kv_factory(blocks) if kv_factory else KVCacheManager(blocks, config.block_size)
            return cls(group, model, kv, config)
        except BaseException as exc:
            lost = group.wait_lost(_exit_wait_s(exc)) if isinstance(exc, Exception) else ""
            group.close()
            if lost:
                raise RankLost(f"tensor-parallel group failed to start: {lost}") from exc
            raise

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world

    def check_ranks(self, wait_s: float = 0.0) -> None:
        """Raise :class:`RankLost` if a rank process is gone (waiting up to ``wait_s`` to see it)."""
        lost = self.group.wait_lost(wait_s) if wait_s else self.group.lost()
        if lost:
            raise RankLost(f"tensor-parallel instance lost a rank: {lost}")

    def execute(self, plan: StepPlan, should_stop: Callable[[], bool] | None = None) -> EngineStepResult:
        """One step on every rank; :class:`RankLost` (the step failed) when a rank is gone."""
        self.check_ranks()
        try:
            return self._execute(plan, should_stop)
        except Exception as exc:
            self.check_ranks(_exit_wait_s(exc))  # a dead peer's collective error: say which rank, not the symptom
            raise

    def _execute(self, plan: StepPlan, should_stop: Callable[[], bool] | None) -> EngineStepResult:
        check = plan.preemptible and should_stop is not None and plan.preempt_granularity != "chunk"
        if plan.plan_id in self._parked:
            self.group.publish(("resume", plan.plan_id, check))
        elif not plan.ops_done and not plan.swap_in and not plan.swap_out:
            seqs = plan_sequences(plan, self.kv)
            if seqs:
                self.group.publish(self.encoder.encode(plan, seqs, prompt_logprob_rows(seqs), self.kv, check))
        agreed = None
        if check:
            self.stop.begin_plan(plan.ops_done, self.num_operators, plan.preempt_granularity)
        if should_stop is not None:
            def agreed() -> bool:
                return self.stop.leader(should_stop())
        return super().execute(plan, agreed)

    def discard(self, plan: StepPlan) -> bool:
        if plan.plan_id in self._parked:
            self.group.publish(("discard", plan.plan_id))
        return super().discard(plan)

    def copy_block(self, copy: BlockCopy) -> None:
        self.group.publish(("copy_block", copy))
        super().copy_block(copy)

    def export_kv(self, request_id: int, num_tokens: int | None = None, *,
                  from_host: bool = False) -> ShardedKVPayload:
        """Every rank's KV heads of the request, gathered here as one sharded payload (each rank's
        export as it is: ``kv_reshard`` cuts it for whatever degree imports it)."""
        if from_host:
            raise TensorParallelError("a tensor-parallel instance has no host KV pool")
        table = self.kv.table(request_id)
        if not table:
            raise KeyError(f"request {request_id} holds no KV blocks")
        if num_tokens is None:
            num_tokens = len(table) * self.kv.block_size
        self.group.publish(("export", list(table), num_tokens))
        local = super().export_kv(request_id, num_tokens)
        shards = gather_to_first(self.group.joined.control, local.kv, self.group.world)
        return ShardedKVPayload(self.full_num_kv_heads, [KVPayload(num_tokens, t) for t in shards])

    def import_kv(self, request_id: int, payload, *, into_host: bool = False) -> None:
        """Each rank imports the KV heads it owns from ``payload`` (a plain payload from one rank or
        a sharded one from a group of any degree)."""
        if into_host:
            raise TensorParallelError("a tensor-parallel instance has no host KV pool")
        world = self.group.world
        parts = [kv_for_rank(payload, self.full_num_kv_heads, world, r) for r in range(world)]
        table = self.kv.table(request_id)
        self.group.publish(("import", list(table), parts[0].num_tokens))
        scatter_from_first(self.group.joined.control,
                           [p.kv.to(self.model.dtype).contiguous() for p in parts], parts[0].kv.shape)
        super().import_kv(request_id, parts[0])

    def close(self) -> None:
        self._finalizer()
