"""One instance's runtime around the scheduler contract, written once for every driver (docs/design.md,
"One instance runtime"): the simulator (virtual time, cost-model steps), the engine's
instance loop (wall time, torch steps), the in-process engine cluster and the instance processes
of ``laneserve serve``. Its verbs are the contract's (:class:`~laneserve.policies.base.InstanceScheduler`):

::

    plan = inst.schedule(now)                         # None: idle until an event or inst.next_wakeup()
    ...                                                # the driver runs the plan, in its own time
    outcome = inst.update(plan, result, now, duration)     # prefilled: hand off; finished: done

What a driver feeds in besides steps:

- ``add_request(req, now)``: a new request enters the scheduler; ``preempt_wanted(now)`` then says
  whether the running (preemptible) step should stop at its next operator boundary.
- ``offer_kv(req, payload)``: a prefilled request whose KV waits to come in (decode side);
  ``admit_kv(now)`` yields each one that fits now with its blocks reserved, in the order the decode
  policy picks (``offer_end``: the oldest first, except adaptive decode's intake rule), and fails
  (finish reason ``error``) one that can never fit this instance's memory.
- ``abort(rid, now)``: drops the request wherever it is here (an offered transfer too).
- ``hand_off(req, export)``: the prefill side of a hand-off (the cluster side is
  :meth:`ClusterRuntime.on_prefilled <laneserve.runtime.cluster.ClusterRuntime.on_prefilled>`):
  the finished prefill's KV is exported and this instance's blocks are let go (``release``).

An instance may carry a ``learner`` (:class:`~laneserve.policies.predictors.LearnedCostModel`,
the ``online`` predictor its policy was bound to): every completed step is fed to it, before the
scheduler advances the counters.

Counters are kept here once: steps, busy time, and preemptions — a step stopped at an operator
boundary counts here, swaps and recomputes a policy makes between steps count in
``scheduler.policy_preemptions``; ``stats()`` adds the two. The router-facing load figures come
from :class:`~laneserve.policies.routing.SchedulerLoad` (offered transfers count as waiting).
Pure Python: no torch, no clock of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Request
from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.policies.routing import SchedulerLoad


class Instance(SchedulerLoad):
    def __init__(self, instance_id: int, scheduler: InstanceScheduler, learner: Any = None) -> None:
        self.instance_id = instance_id
        self.scheduler = scheduler
        self.learner = learner                          # online predictor fed with every step
        self.role = scheduler.role
        self.accepting = True
        self.plan: StepPlan | None = None               # the step running now
        self.pending: deque[tuple[Request, Any]] = deque()   # offered KV transfers, arrival order
        self.steps = 0
        self.busy_time = 0.0
        self.preemptions = 0                            # steps stopped at an operator boundary
        #: kept only when a router asks (``record_decode``): the last completed pure decode step
        #: as (requests, context sum, longest context, seconds), a new tuple for each such step
        self.record_decode = False
        self.last_decode: tuple[int, int, int, float] | None = None

    # ---- load figures ----------------------------------------------------------------------
    def _outside(self) -> list[Request]:
        return [req for req, _ in self.pending]

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self.pending)   # (routers ask often: no list)

    # ---- steps -----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        """The scheduler's next plan (now running), or None when it has nothing to run now."""
        plan = self.scheduler.schedule(now)
        self.plan = plan
        return plan

    def update(self, plan: StepPlan, result: StepResult, now: float, duration: float) -> StepOutcome:
        """The step ``plan`` ended at ``now`` after ``duration`` seconds (``result.completed`` False:
        it stopped at an operator boundary and is parked); request state advances."""
        self.plan = None
        self.steps += 1
        self.busy_time += duration
        if not result.completed:
            self.preemptions += 1
        else:
            if self.learner is not None:
                self.learner.observe(plan, duration)
            if self.record_decode and plan.decodes and not (plan.prefills or plan.swap_in or plan.swap_out):
                ctx = [r.context_len for r in plan.decodes]
                self.last_decode = (len(ctx), sum(ctx), max(ctx), duration)
        return self.scheduler.update(plan, result, now)

    # ---- events ----------------------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> None:
        self.scheduler.add_request(req, now)

    def preempt_wanted(self, now: float) -> bool:
        """Whether the running step should stop at its next operator boundary (asked after an
        arrival or a policy wake-up; FlowPrefill Algorithm 2)."""
        plan = self.plan
        return plan is not None and plan.preemptible and self.scheduler.should_preempt(plan, now)

    def next_wakeup(self) -> float | None:
        return self.scheduler.next_wakeup()

    def offer_kv(self, req: Request, payload: Any = None) -> None:
        self.pending.append((req, payload))

    def admit_kv(self, now: float, on_drop: Callable[[Request, Any], None] | None = None,
                 ) -> Iterator[tuple[Request, Any]]:
        """Offered transfers that fit now, with their blocks reserved (the policy decides where:
        device or host pool), each taken from the end its policy names (``offer_end``); stops at
        the first that does not fit yet. One that can never fit this instance's KV memory is
        dropped (``on_drop(req, payload)``: free what it holds elsewhere) and finished with
        ``error``."""
        sched, pending = self.scheduler, self.pending
        while pending:
            end = sched.offer_end(pending, now)
            req, payload = pending[end]
            fits = sched.kv.fits_ever(req.context_len + 1)
            if fits and not sched.can_reserve(req):
                return
            pending.popleft() if end == 0 else pending.pop()
            if not fits:
                if on_drop is not None:
                    on_drop(req, payload)
                req.finish(now, "error")
                continue
            sched.reserve(req)
            yield req, payload

    def hand_off(self, req: Request, export: Callable[[Request], Any]) -> Any:
        """The prefill side of ``req``'s hand-off: ``export(req)`` (a host copy of its KV, a
        transport descriptor) is returned once this instance's blocks are let go. An ``export``
        that raises leaves them held (the caller aborts the request)."""
        payload = export(req)
        self.release(req)
        return payload

    def release(self, req: Request) -> None:
        """``req``'s KV left this instance: its blocks are freed."""
        self.scheduler.release(req.request_id)

    def abort(self, request_id: int, now: float, reason: str = "abort") -> tuple[Request | None, Any]:
        """Drop ``request_id`` here; returns (the request, the payload of its offered transfer if it
        had not come in yet, which the caller must discard)."""
        for k, (req, payload) in enumerate(self.pending):
            if req.request_id == request_id:
                del self.pending[k]
                return req, payload
        return self.scheduler.abort(request_id, now, reason), None

    # ---- figures -----------------------------------------------------------------------------
    @property
    def total_preemptions(self) -> int:
        return self.preemptions + self.scheduler.policy_preemptions

    def stats(self, elapsed: float) -> dict[str, Any]:
        s = self.scheduler
        cache = s.prefix_cache
        return {"instance": self.instance_id, "role": self.role, "steps": self.steps, "busy_time": self.busy_time,
                "utilization": self.busy_time / max(elapsed, 1e-9), "preemptions": self.total_preemptions,
                **(cache.stats() if cache is not None else {})}
