"""Discrete-event simulation of a PD-disaggregated (or colocated) cluster.

Events: request arrival (rejected when prompt + output exceed the model's context, as the
server does), step finished (or stopped at an operator boundary), KV transfer done,
and policy wake-ups. Each instance is the shared runtime (:class:`~laneserve.runtime.Instance`:
steps, arrivals, preemption questions, KV intake, counters) driven in virtual time: this module
only turns its answers into future events. KV transfers queue per destination link; every
instance has a KV memory limit (prefill admission waits for memory, decode reservations wait,
decode growth preempts). Consecutive decode steps of a stable batch run as one event
(:mod:`laneserve.sim.macro`, ``macro_steps``; exact). Deterministic: at equal times arrivals come
first, then step ends of decode instances, then the rest by event sequence number; nothing here
draws random numbers.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

from laneserve.core.kv import HostKVPool, KVCacheManager, blocks_for
from laneserve.core.plan import StepResult
from laneserve.core.prefix_cache import PrefixCache
from laneserve.core.request import Phase, Request, RequestSpec
from laneserve.costmodel.base import CostModel
from laneserve.policies.predictors import PredictorSource
from laneserve.runtime import Instance
from laneserve.runtime.build import InstanceResources, build_instance
from laneserve.runtime.cluster import ClusterRuntime
from laneserve.runtime.spec import InstanceSpec
from laneserve.sim.config import ClusterConfig, context_limit, default_host_kv_tokens, kv_capacity_tokens
from laneserve.sim.executor import SimExecutor
from laneserve.sim.macro import DecodeRun, stable_decode_plan

#: young-generation threshold of the garbage collector during a run (fewer_collections)
GC_YOUNG_THRESHOLD = 50_000

_STEP, _TRANSFER, _WAKEUP = 0, 1, 2
_DECODE_FIRST = 1 << 62      # taken off the sequence number of a decode instance's step end


class SimInstance(Instance):
    """The runtime plus what the simulator's events need: the running step's precomputed result
    and start, a token that invalidates its end event when a preemption moves it, the operator
    count it will stop at, the pending wake-up, the incoming KV link's next free time and the run
    of decode steps in progress (one event for many steps)."""

    def __init__(self, instance_id: int, role: str, scheduler, learner=None) -> None:
        super().__init__(instance_id, scheduler, learner)
        self.role = role
        self.result: StepResult | None = None
        self.step_start = 0.0
        self.step_token = 0
        self.preempt_at: int | None = None       # op count at which the running step will stop
        self.wakeup_at: float | None = None
        self.link_free_at = 0.0                  # incoming KV link (decode instances)
        self.run: DecodeRun | None = None
        self.tie = _DECODE_FIRST if role == "decode" else 0

    @property
    def queued_tokens(self) -> int:
        if self.run is not None:      # the tokens of the steps a run has ended are counted lazily
            self.run.count()
        return super().queued_tokens


@dataclass(slots=True)
class SimResult:
    requests: list[Request]
    duration: float
    config: ClusterConfig
    instances: list[dict]
    events: int
    wall_seconds: float
    unfinished: int = 0

    @property
    def finished(self) -> list[Request]:
        return [r for r in self.requests if r.phase is Phase.FINISHED]


@contextmanager
def fewer_collections(young: int = GC_YOUNG_THRESHOLD) -> Iterator[None]:
    """Run the cyclic garbage collector's youngest generation every ``young`` allocations instead
    of Python's 700 for the duration of the block (restored after). A run allocates events,
    plans and outcomes by the million, almost none of them in reference cycles, and each young
    collection also walks whatever the caller keeps alive: on the Azure trace (4P+4D) a run is
    about 5% faster with this threshold on a quiet machine (interleaved runs), 10-15% under load. Memory is still freed by reference counting as before."""
    old = gc.get_threshold()
    gc.set_threshold(max(young, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


class _SimResources(InstanceResources):
    """The simulator's side of :func:`~laneserve.runtime.build.build_instance`: exclusive KV pools
    (no forks and no prefix caching in its managers: its prefix cache is a PrefixCache beside
    them), sized from the cost model's memory when the spec gives no size; the run's predictors
    for every policy that reads them (online: a learner of its own); the per-role option
    defaults of the config (``prefill_opts``, ``decode_opts``)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim, self.cfg = sim, sim.config
        self.default_tokens = kv_capacity_tokens(sim.cost, self.cfg.gpu_memory_utilization)

    def kv(self, spec: InstanceSpec) -> KVCacheManager:
        bs = self.cfg.block_size
        return KVCacheManager(blocks_for(spec.kv_tokens or self.default_tokens, bs), bs, exclusive=True)

    def host_pool(self, spec: InstanceSpec) -> HostKVPool | None:
        tokens = default_host_kv_tokens(self.sim.cost) if spec.host_kv_tokens is None else spec.host_kv_tokens
        bs = self.cfg.block_size
        return HostKVPool(blocks_for(tokens, bs), bs, exclusive=True) if tokens else None

    def policy_defaults(self, spec: InstanceSpec) -> dict:
        return self.cfg.decode_opts if spec.role == "decode" else self.cfg.prefill_opts

    def predictors(self):
        return self.sim.predictors.for_instance()

    def instance(self, instance_id, spec, scheduler, kv, host, learner) -> SimInstance:
        return SimInstance(instance_id, spec.role, scheduler, learner)


class Simulator:
    """``macro_steps=False`` runs every decode step as its own event (the reference the macro
    runs are checked against; identical results, several times slower)."""

    def __init__(self, config: ClusterConfig, cost: CostModel, *, macro_steps: bool = True) -> None:
        self.config = config
        self.cost = cost
        self.executor = SimExecutor(cost, swap_link=config.swap_link)
        self.macro_steps = macro_steps

    # ---- set-up ----------------------------------------------------------------------------
    def _make_instances(self) -> tuple[list[SimInstance], list[SimInstance]]:
        cfg = self.config
        deployment = cfg.deployment
        self.predictors = PredictorSource(cfg.predictor, self.cost)
        resources = _SimResources(self)
        instances = [build_instance(i, spec, resources) for i, spec in enumerate(cfg.instance_specs())]
        front, back = instances[:deployment.num_prefill], instances[deployment.num_prefill:]
        if cfg.prefix_cache_tokens is not None and not deployment.colocated:
            for inst in front:
                inst.scheduler.bind_prefix_cache(
                    PrefixCache(cfg.prefix_cache_tokens or cfg.prefill_kv_tokens or resources.default_tokens))
        return front, back

    # ---- the run -----------------------------------------------------------------------------
    def run(self, specs: Iterable[RequestSpec], *, slo_scale: float = 1.0,
            progress: Callable[[int, int], None] | None = None) -> SimResult:
        with fewer_collections():
            return self._run(specs, slo_scale=slo_scale, progress=progress)

    def _run(self, specs: Iterable[RequestSpec], *, slo_scale: float,
             progress: Callable[[int, int], None] | None) -> SimResult:
        wall0 = time.perf_counter()
        cfg = self.config
        requests = [Request.from_spec(s, slo_scale=slo_scale, record_token_times=cfg.record_token_times)
                    for s in specs]
        requests.sort(key=lambda r: (r.arrival_time, r.request_id))
        front, back = self._make_instances()
        self.front, self.back = front, back
        run = _Run(self, front, back)
        now, events = run.loop(requests, progress)
        unfinished = 0
        for req in requests:
            if not req.is_finished:
                unfinished += 1
                req.finish(now, "error")
        if progress is not None:
            progress(len(requests), len(requests))
        first = requests[0].arrival_time if requests else 0.0
        stats = [inst.stats(now - first) for inst in (*front, *back)]
        return SimResult(requests=requests, duration=now - first, config=cfg, instances=stats,
                         events=events, wall_seconds=time.perf_counter() - wall0, unfinished=unfinished)


class _Run:
    """One run's event loop: the event heap and what each event does to the instances. The
    decisions between instances (admission routing, the hand-off, the decode router) are the
    cluster runtime's (:class:`~laneserve.runtime.cluster.ClusterRuntime`); this class is its
    driver in virtual time, and :class:`_SimLink` is how a KV payload travels here."""

    def __init__(self, sim: Simulator, front: list[SimInstance], back: list[SimInstance]) -> None:
        cfg = sim.config
        self.front, self.back = front, back
        self.cost, self.executor, self.link = sim.cost, sim.executor, cfg.kv_link
        self.limit = context_limit(cfg, sim.cost)
        self.macro = sim.macro_steps
        self.runtime = ClusterRuntime(cfg.deployment, _SimLink(self), front=front, back=back,
                                      step_model=sim.predictors.for_instance)
        self.reads_contexts = self.runtime.reads_step_times
        if self.reads_contexts:              # the router predicts step times from their last steps
            for inst in back:
                inst.record_decode = True
        self.heap: list[tuple] = []
        self.seq = 0

    def push(self, t: float, tie: int, kind: int, inst: SimInstance, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq - tie, kind, inst, payload))

    # ---- the loop ----------------------------------------------------------------------------
    def loop(self, requests: list[Request], progress: Callable[[int, int], None] | None) -> tuple[float, int]:
        """Every event until none is left: (the time of the last, the number of events)."""
        heap = self.heap
        pop = heapq.heappop
        total, next_arrival, now, events = len(requests), 0, 0.0, 0
        while True:
            if next_arrival < total and (not heap or requests[next_arrival].arrival_time <= heap[0][0]):
                req = requests[next_arrival]
                next_arrival += 1
                now = req.arrival_time
                self.arrive(req, now)
                events += 1
                if progress is not None and next_arrival % 1000 == 0:
                    progress(next_arrival, total)
                continue
            if not heap:
                return now, events
            now, _, kind, inst, payload = pop(heap)
            events += 1
            if kind == _STEP:
                self.on_step_end(inst, payload, now)
            elif kind == _TRANSFER:
                self.on_transfer_end(inst, payload, now)
            else:
                self.on_wakeup(inst, now)

    # ---- events ------------------------------------------------------------------------------
    def arrive(self, req: Request, t: float) -> None:
        if self.limit is not None and req.prompt_len + req.max_output_tokens > self.limit:
            req.finish(t, "rejected")          # the server's 400: beyond the model's context
            return
        inst = self.runtime.admit(req, t)
        if not inst.scheduler.kv.fits_ever(req.prompt_len + 1):
            req.finish(t, "error")
            return
        inst.add_request(req, t)
        self.nudge(inst, t)

    def on_step_end(self, inst: SimInstance, token: int, now: float) -> None:
        if token != inst.step_token:
            return                                # superseded by a preemption or a shorter run
        run = inst.run
        if run is not None:
            if run.extend(self.cost):             # the end of a chunk, the batch unchanged: go on
                self.push(run.end_time, inst.tie, _STEP, inst, token)
                return
            run.sync(now)                         # the last step of the run: count the ones before
            inst.run = None
        plan, result = inst.plan, inst.result
        if inst.preempt_at is not None:           # stopped at an operator boundary
            result = StepResult(duration=now - inst.step_start, completed=False)
            plan.ops_done = inst.preempt_at
        inst.result = None
        outcome = inst.update(plan, result, now, now - inst.step_start)
        for req in outcome.prefilled:
            self.sync_decoders(now)
            self.runtime.on_prefilled(req, inst, now)
        if inst.role != "prefill" and outcome.finished:
            self.try_transfers(inst, now)
        self.start_step(inst, now)

    def on_transfer_end(self, dec: SimInstance, req: Request, now: float) -> None:
        req.times.transfer_end = now
        src = self.front[req.prefill_instance]
        src.release(req)                          # the prefill side held the KV until now
        if src.plan is None:
            self.start_step(src, now)
        self.touch(dec, now)
        dec.add_request(req, now)
        if dec.plan is None:
            self.start_step(dec, now)

    def on_wakeup(self, inst: SimInstance, now: float) -> None:
        if inst.wakeup_at is not None and now >= inst.wakeup_at:
            inst.wakeup_at = None
        self.nudge(inst, now)

    def nudge(self, inst: SimInstance, t: float) -> None:
        """Something happened that the instance's policy may act on: an idle instance starts a
        step; a running preemptible one may stop at an operator boundary."""
        if inst.plan is None:
            self.start_step(inst, t)
        elif inst.plan.preemptible:
            self.try_preempt(inst, t)
            self.rearm(inst, t)

    # ---- steps -------------------------------------------------------------------------------
    def start_step(self, inst: SimInstance, t: float) -> None:
        plan = inst.schedule(t)
        if plan is None:
            self.schedule_wakeup(inst, t)
            return
        cost = self.cost
        run = DecodeRun.start(inst, plan, t, cost) if self.macro and stable_decode_plan(inst, plan) else None
        result = self.executor.execute(plan) if run is None else StepResult(duration=run.first)
        inst.result, inst.step_start = result, t
        inst.step_token += 1
        inst.preempt_at = None
        end = t + result.duration
        if run is not None and run.steps > 1:
            inst.run, end = run, run.end_time
        self.push(end, inst.tie, _STEP, inst, inst.step_token)
        if plan.preemptible:          # a wake-up may preempt it (FlowPrefill suspension bound)
            self.schedule_wakeup(inst, t)

    def schedule_wakeup(self, inst: SimInstance, t: float) -> None:
        wake = inst.scheduler.next_wakeup()
        if wake is not None and wake != inst.wakeup_at:
            inst.wakeup_at = wake
            self.push(max(wake, t), 0, _WAKEUP, inst, 0)

    def rearm(self, inst: SimInstance, t: float) -> None:
        """After a preemption check that did not stop the running step: a policy may now want
        a look at a later time (LAPS' AWD window closing during a long chunk)."""
        wake = inst.scheduler.next_wakeup()
        if inst.preempt_at is None and wake is not None and wake > t:
            self.schedule_wakeup(inst, t)

    def try_preempt(self, inst: SimInstance, t: float) -> None:
        plan = inst.plan
        if inst.preempt_at is not None or not inst.preempt_wanted(t):
            return
        bounds = SimExecutor.boundaries(plan)
        if not bounds:
            return
        cum = list(accumulate(plan.op_times[plan.ops_done:]))
        for k in bounds:
            end = inst.step_start + cum[k - plan.ops_done - 1]
            if end >= t:
                inst.preempt_at = k
                inst.step_token += 1
                self.push(end, inst.tie, _STEP, inst, inst.step_token)
                return

    # ---- decode side -------------------------------------------------------------------------
    def sync_decoders(self, now: float) -> None:
        """The decode router reads the decode instances' memory as of ``now`` (and, reading
        contexts, their counters): their runs count the steps ended so far."""
        for dec in self.back:
            if dec.run is None:
                continue
            if self.reads_contexts:
                dec.run.sync(now)
            else:
                dec.run.grow(now)

    def try_transfers(self, dec: SimInstance, t: float) -> bool:
        """Start the offered transfers that fit now; True if any did (memory was reserved)."""
        reserved = False
        for req, _ in dec.admit_kv(t, on_drop=self.release_source):
            reserved = True
            start = dec.link_free_at if dec.link_free_at > t else t
            end = start + self.cost.kv_transfer_time(req.num_computed_tokens, self.link)
            dec.link_free_at = end
            req.times.transfer_start = start
            self.push(end, 0, _TRANSFER, dec, req)
        return reserved

    def touch(self, dec: SimInstance, t: float) -> None:
        """Something changes ``dec``'s batch or memory at ``t``: its run ends with the step
        running now."""
        run = dec.run
        if run is not None and run.truncate(t):
            dec.step_token += 1
            self.push(run.end_time, dec.tie, _STEP, dec, dec.step_token)

    def release_source(self, req: Request, _payload) -> None:
        """A transfer that can never fit its decode instance: its prefill KV is let go."""
        if req.prefill_instance is not None:
            self.front[req.prefill_instance].release(req)


class _SimLink:
    """The simulator's KV link (:class:`~laneserve.runtime.cluster.KVLink`): the prefill instance
    keeps the KV until its transfer ends (:meth:`_Run.on_transfer_end` releases it); an offer
    starts its transfer once the decode instance can reserve its blocks, transfers to one decode
    instance queueing on its incoming link."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def take(self, source: SimInstance, req: Request, now: float) -> None:
        return None

    def deliver(self, req: Request, dec: SimInstance, payload, now: float) -> None:
        run = self.run
        dec_run = dec.run
        if dec_run is not None:        # the policy may read its requests' counters
            dec_run.sync(now)
        dec.offer_kv(req)
        # a reservation leaves the batch as it is: a run goes on if its growth still fits
        if run.try_transfers(dec, now) and dec_run is not None and not dec_run.growth_fits():
            run.touch(dec, now)

    def discard(self, req: Request, payload) -> None:
        pass


def simulate(specs: Sequence[RequestSpec], cost: CostModel, config: ClusterConfig | None = None,
             **kwargs) -> SimResult:
    """One-call convenience: ``simulate(workload.specs, make_cost_model(), ClusterConfig(...))``."""
    return Simulator(config or ClusterConfig(), cost).run(specs, **kwargs)
