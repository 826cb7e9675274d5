"""The loop of ranks 1..N-1: join the group, load this rank's shard, size the KV cache as agreed,
then run each step rank 0 broadcasts: the same forward as rank 0 on this rank's heads (the
all-reduces and the logits gather meet rank 0's), parking and resuming preemptible plans
where the stop agreement says. These ranks never sample and never schedule.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from laneserve.engine.attention import sdpa_backends
from laneserve.engine.executor import EngineExecutor
from laneserve.engine.tp.channel import ChannelClosed, ChannelHandle, ChannelReader
from laneserve.engine.kv_cache import KVPayload
from laneserve.engine.tp.group import (GroupSpec, agree_min, barrier, gather_to_first, join, local_kv_blocks,
                                       parent_alive, process_alive, scatter_from_first)
from laneserve.engine.tp.loader import load_shard
from laneserve.engine.tp.step_message import StepMessage, StepMirror
from laneserve.engine.tp.stop import make_stop_agreement

log = logging.getLogger(__name__)


class _WorkerPlan:
    """The plan attributes the executor's operator loop reads."""

    def __init__(self, msg: StepMessage) -> None:
        self.plan_id = msg.plan_id
        self.preemptible = msg.preemptible
        self.preempt_granularity = msg.granularity
        self.padded_shape = msg.padded_shape
        self.ops_done = 0
        self.op_times = None


class RankWorker:
    def __init__(self, spec: GroupSpec, rank: int) -> None:
        if spec.config.num_threads is not None:
            torch.set_num_threads(spec.config.num_threads)
        joined = join(spec, rank)
        self.stop = make_stop_agreement(joined.control, spec.world, rank, spec.stop_board)
        barrier(joined.control)                      # rank 0 unlinks the board's name after it
        self.model = load_shard(spec.model_path, rank, spec.world, joined.device, spec.config.dtype, joined.comm)
        blocks = agree_min(joined.control, local_kv_blocks(spec.config, self.model))
        self.mirror = StepMirror(blocks, spec.config.block_size)
        self.executor = EngineExecutor(self.model, self.mirror, spec.config)  # type: ignore[arg-type]
        self.steps = 0
        self.control, self.world = joined.control, spec.world

    def step(self, msg) -> None:
        ex = self.executor
        with torch.inference_mode(), sdpa_backends(self.model.device):
            if isinstance(msg, StepMessage):
                seqs, prompt_rows = self.mirror.apply(msg)
                plan = _WorkerPlan(msg)
                forward = ex.runner.forward(ex.runner.prepare(seqs, msg.padded_shape, prompt_rows))
                check = msg.check
            else:                                         # ("resume", plan_id, check)
                parked = ex._parked.pop(msg[1])
                plan, forward, seqs, check = parked.plan, parked.forward, parked.seqs, msg[2]
            if check:
                self.stop.begin_plan(plan.ops_done, ex.num_operators, plan.preempt_granularity)
            ex._advance(plan, forward, seqs, self.stop.follower if check else None, time.perf_counter())
        self.steps += 1

    def handle(self, msg) -> bool:
        """Run one message; False when it says to stop."""
        if isinstance(msg, StepMessage) or msg[0] == "resume":
            self.step(msg)
        elif msg[0] == "discard":
            self.executor._parked.pop(msg[1], None)
        elif msg[0] == "export":                      # (export, table, num_tokens)
            payload = self.executor.runner.cache.export_tokens(msg[1], msg[2])
            gather_to_first(self.control, payload.kv, self.world)
        elif msg[0] == "import":                      # (import, table, num_tokens)
            cache = self.executor.runner.cache
            shape = (cache.num_layers, 2, msg[2], cache.num_kv_heads, cache.head_dim)
            kv = scatter_from_first(self.control, [], shape, self.model.dtype)
            with torch.inference_mode():
                cache.import_tokens(msg[1], KVPayload(msg[2], kv))
        elif msg[0] == "copy_block":
            self.executor.copy_block(msg[1])
        elif msg[0] == "shutdown":
            return False
        else:
            raise ValueError(f"unknown rank message {msg[0]!r}")
        return True


def rank_main(spec: GroupSpec, rank: int, handle: ChannelHandle, parent_pid: int, watch: str = "parent") -> None:
    """Entry point of a spawned rank process (or a rank actor): it runs while rank 0 does, rank 0
    being its parent (``watch="parent"``) or, for a Ray actor, the process ``parent_pid`` (``"pid"``)."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    alive = parent_alive(parent_pid) if watch == "parent" else process_alive(parent_pid)
    reader = ChannelReader(handle)
    try:
        worker = RankWorker(spec, rank)
        while worker.handle(reader.receive(alive)):
            pass
    except ChannelClosed:
        sys.exit(0)
    finally:
        reader.close()
