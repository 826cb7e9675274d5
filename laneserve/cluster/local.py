"""An in-process PD cluster of real engine instances, one thread each (the engine's counterpart of
the simulator's cluster, used for replaying traces and for the twin check).

Each instance thread loops over its :class:`EngineInstance`; admission and the hand-off are the
cluster runtime's (:class:`~laneserve.runtime.cluster.ClusterRuntime`): a finished prefill is
exported from its prefill executor (a host copy of its KV, :class:`_LocalLink`), and handed to a
decode instance chosen by the decode router, whose thread reserves blocks, imports the KV and
starts decoding it. The prefill instance
frees its blocks once the KV is exported (the host copy carries it), so prefill memory is not held
during the transfer — a difference from the simulator that matters only under memory pressure.
Instances share one model object (weights are read-only) and one wall clock. A role given a
tensor-parallel degree above one runs each of its instances as a rank group instead
(:class:`~laneserve.engine.tp.executor.TPExecutor`: rank 0 in the instance's thread, ranks
1..N-1 as processes of their own); :meth:`LocalCluster.close` stops them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from laneserve.core.clock import WallClock
from laneserve.core.request import Request
from laneserve.engine.config import EngineConfig
from laneserve.engine.instance import EngineInstance
from laneserve.engine.resources import EngineResources
from laneserve.runtime.build import build_instance
from laneserve.runtime.cluster import (DEFAULT_DECODE_POLICY, DEFAULT_DECODE_ROUTER, DEFAULT_PREFILL_POLICY,
                                       DEFAULT_ROUTER, ClusterRuntime, Deployment, learned_step_model)


class _DecodeView:
    """A decode instance as the routers of other threads read it: its load figures live, its
    decode summary as of its own thread's last look (the summary walks the requests its thread
    changes). ``lock`` orders the offers other threads make against its thread's intake."""

    def __init__(self, instance: EngineInstance, summaries: bool) -> None:
        self.instance = instance
        self.lock = threading.Lock()
        self.summaries = summaries        # a router reads them (tpot-aware): kept up to date
        self.summary = instance.decode_summary()

    def publish(self) -> None:
        if not self.summaries:
            return
        with self.lock:
            self.summary = self.instance.decode_summary()

    def decode_summary(self):
        return self.summary

    def __getattr__(self, name: str):
        return getattr(self.instance, name)


class _Worker:
    def __init__(self, instance: EngineInstance, cluster: LocalCluster, view: _DecodeView | None = None) -> None:
        self.instance = instance
        self.cluster = cluster
        self.view = view                  # decode instances: what the routers read
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"instance-{instance.instance_id}", daemon=True)
        self.error: BaseException | None = None

    def _take_kv(self) -> None:
        inst, cluster, view = self.instance, self.cluster, self.view
        if view is None:                  # nothing is offered to it from other threads
            inst.take_kv(lambda payload: payload, on_drop=lambda req, _: cluster._finished(req))
            return
        with view.lock:
            inst.take_kv(lambda payload: payload, on_drop=lambda req, _: cluster._finished(req))
        view.publish()

    def _loop(self) -> None:
        inst, cluster = self.instance, self.cluster
        try:
            while not cluster.stopping:
                self._take_kv()
                outcome = inst.step()
                if outcome is not None and self.view is not None:
                    self.view.publish()
                if outcome is None:
                    due = inst.next_due()
                    timeout = 0.05 if due is None else max(0.0, min(0.05, due - inst.clock.now()))
                    self.wake.wait(timeout)
                    self.wake.clear()
                    continue
                for req in outcome.prefilled:
                    cluster.runtime.on_prefilled(req, inst, inst.clock.now())
                for req in outcome.finished:
                    cluster._finished(req)
        except BaseException as exc:  # surfaced by LocalCluster.run
            self.error = exc
            cluster.stopping = True


class _LocalLink:
    """The in-process KV link (:class:`~laneserve.runtime.cluster.KVLink`): the prefill instance
    exports a host copy and frees its blocks at once; the decode instance's thread imports it."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def take(self, source: EngineInstance, req: Request, now: float):
        req.times.transfer_start = now
        return source.hand_off(req, lambda r: source.executor.export_kv(r.request_id, r.num_computed_tokens))

    def deliver(self, req: Request, dest: _DecodeView, payload, now: float) -> None:
        with dest.lock:
            dest.instance.offer_kv(req, payload)
        self.cluster.workers[dest.instance_id].wake.set()

    def discard(self, req: Request, payload) -> None:
        self.cluster._finished(req)


class LocalCluster:
    """``deployment`` (a :class:`~laneserve.runtime.cluster.Deployment`) gives topology,
    policies and routers; the keyword arguments build one when it is not given (the defaults are
    every entry point's: adaptive prefill and decode, round-robin, the decode policy's own decode
    router)."""

    def __init__(self, model_path, *, num_prefill: int = 1, num_decode: int = 1,
                 prefill_policy: str = DEFAULT_PREFILL_POLICY, decode_policy: str = DEFAULT_DECODE_POLICY,
                 router: str = DEFAULT_ROUTER, decode_router: str = DEFAULT_DECODE_ROUTER,
                 config: EngineConfig | None = None, kv_tokens: int = 65536,
                 deployment: Deployment | None = None, prefill_tensor_parallel_size: int = 1,
                 decode_tensor_parallel_size: int = 1) -> None:
        config = config or EngineConfig(num_threads=1)
        self.config = config
        self.deployment = deployment = deployment or Deployment(
            num_prefill=num_prefill, num_decode=num_decode, prefill_policy=prefill_policy,
            decode_policy=decode_policy, router=router, decode_router=decode_router)
        degrees = {"prefill": prefill_tensor_parallel_size, "decode": decode_tensor_parallel_size,
                   "colocated": prefill_tensor_parallel_size}
        for name, degree in (("prefill", prefill_tensor_parallel_size), ("decode", decode_tensor_parallel_size)):
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"{name}_tensor_parallel_size must be a positive integer, got {degree!r}")
        # decode-side instances get a host pool (swap preemption, AlignedServe's KV pool) when
        # config.num_host_blocks asks for one; scheduler and executor share it
        host = config.num_host_blocks * config.block_size
        self.specs = deployment.instance_specs(lambda role: {
            "kv_tokens": max(kv_tokens, config.block_size), "device": config.device,
            "host_kv_tokens": 0 if role == "prefill" else host, "tensor_parallel_size": degrees[role],
            "token_budget": config.max_num_batched_tokens if role == "colocated" else None})
        if config.num_threads is not None:
            import torch
            torch.set_num_threads(config.num_threads)
        self.clock = WallClock()
        self.resources = EngineResources(model_path, config, clock=self.clock)
        self.tp_executors = self.resources.tp_executors
        try:
            instances = [build_instance(i, spec, self.resources) for i, spec in enumerate(self.specs)]
        except BaseException:
            self.close()
            raise
        self.prefill = instances[:deployment.num_prefill]
        self.decode = instances[deployment.num_prefill:]
        self.runtime = ClusterRuntime(deployment, _LocalLink(self), front=self.prefill,
                                      step_model=lambda: learned_step_model(config.attention))
        views = [_DecodeView(inst, self.runtime.reads_step_times) for inst in self.decode]
        self.runtime.attach(self.prefill, views)
        for inst in self.decode:           # a decode router that predicts steps reads their last one
            inst.record_decode = self.runtime.reads_step_times
        self.workers = {inst.instance_id: _Worker(inst, self) for inst in self.prefill}
        self.workers.update({v.instance_id: _Worker(v.instance, self, v) for v in views})
        self.stopping = False
        self._done: list[Request] = []
        self._done_lock = threading.Lock()
        self._all_done = threading.Event()
        self._expected = 0

    def close(self) -> None:
        """Stop the rank processes of every tensor-parallel instance (also done when the
        cluster is collected or the process exits)."""
        self.resources.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- callbacks from worker threads -------------------------------------------------------
    def _finished(self, req: Request) -> None:
        with self._done_lock:
            self._done.append(req)
            if len(self._done) >= self._expected:
                self._all_done.set()

    # ---- driving -------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], *, timeout: float = 600.0,
            on_progress: Callable[[int], None] | None = None) -> list[Request]:
        """Replay ``requests`` at their ``arrival_time`` (seconds from now) and wait for all of
        them. Arrival times are re-based onto the cluster clock."""
        self._expected = len(requests)
        self._done.clear()
        self._all_done.clear()
        self.stopping = False
        for w in self.workers.values():
            w.thread.start()
        start = self.clock.now()
        deadline = time.monotonic() + timeout
        try:
            for req in sorted(requests, key=lambda r: r.arrival_time):
                at = start + req.arrival_time
                req.arrival_time = req.times.arrival = at
                delay = at - self.clock.now()
                if delay > 0:
                    time.sleep(delay)
                inst = self.runtime.admit(req, self.clock.now())
                inst.submit(req, at=at)
                self.workers[inst.instance_id].wake.set()
                self._check_workers()
            while not self._all_done.wait(0.1):
                self._check_workers()
                if on_progress is not None:
                    on_progress(len(self._done))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self._done)}/{len(requests)} requests done after {timeout} s")
        finally:
            self.stopping = True
            for w in self.workers.values():
                w.wake.set()
                if w.thread.is_alive():
                    w.thread.join(timeout=5)
        self._check_workers()
        return list(self._done)

    def _check_workers(self) -> None:
        for w in self.workers.values():
            if w.error is not None:
                raise RuntimeError(f"instance {w.instance.instance_id} failed") from w.error
