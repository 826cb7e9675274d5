"""One engine instance: the shared instance runtime (:class:`~laneserve.runtime.Instance`) driven
in wall time on real tensors (docs/design.md, "The central contract")::

    plan = inst.schedule(now); result = executor.execute(plan, should_stop); inst.update(...)

Requests enter through an :class:`Inbox`, stamped with the time they are due (trace replay) or
now; any thread may put into it (an instance process's receiver thread does, as router messages
come in), and the instance drains it at the start of each step and, while a preemptible prefill
runs, at every operator boundary (the executor asks ``should_stop``): it then takes due arrivals
into the scheduler and asks whether to preempt (FlowPrefill Algorithm 2: decisions on arrival and
completion events only). Prefilled requests
from another instance are offered (``offer_kv``) and taken in by :meth:`take_kv` when their
blocks fit. A logits row the sampler cannot sample fails that request alone (``failed``).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from itertools import count
from typing import Any

from laneserve.core.clock import Clock, WallClock
from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.runtime import Instance


class Inbox:
    """Requests on their way into an instance, due at a clock time: :meth:`put` from any thread,
    :meth:`drain` (the due ones, in due order) from the instance's loop."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Request]] = []
        self._seq = count()
        self._lock = threading.Lock()

    def put(self, req: Request, at: float | None = None) -> None:
        """``req`` is due at clock time ``at`` (default: now)."""
        with self._lock:
            heapq.heappush(self._heap, (self.clock.now() if at is None else at, next(self._seq), req))

    def drain(self, now: float) -> list[Request]:
        """Take out every request due by ``now``."""
        with self._lock:
            heap, due = self._heap, []
            while heap and heap[0][0] <= now:
                due.append(heapq.heappop(heap)[2])
            return due

    def next_due(self) -> float | None:
        with self._lock:
            return self._heap[0][0] if self._heap else None

    def requests(self) -> list[Request]:
        """The requests waiting in it (a copy)."""
        with self._lock:
            return [r for _, _, r in self._heap]

    def __len__(self) -> int:
        return len(self._heap)


class EngineInstance(Instance):
    def __init__(self, scheduler: InstanceScheduler, executor, *, clock: Clock | None = None,
                 instance_id: int = 0, stop_checker=None, inbox: Inbox | None = None) -> None:
        if scheduler.prefix_caching and not scheduler.kv.prefix_caching:
            raise ValueError("prefix_caching=true needs a KV manager that keeps prompt KV "
                             "(EngineConfig.prefix_caching, on by default for prefill and colocated instances)")
        super().__init__(instance_id, scheduler)
        self.executor = executor
        self.clock = clock or WallClock()
        self.stop_checker = stop_checker
        self.inbox = Inbox(self.clock) if inbox is None else inbox
        self.failed: dict[int, str] = {}               # requests the last step failed (rid -> why)
        self.kv_forks = 0                              # samples that shared another's prompt blocks

    # ---- input ---------------------------------------------------------------------------
    def submit(self, req: Request, at: float | None = None) -> None:
        """Hand ``req`` to this instance, due at clock time ``at`` (default: now). Thread-safe."""
        self.inbox.put(req, at)

    def take_arrivals(self, now: float | None = None) -> int:
        """Move every due request from the inbox into the scheduler; returns how many."""
        now = self.clock.now() if now is None else now
        due = self.inbox.drain(now)
        for req in due:
            self.add_request(req, now)
        return len(due)

    def next_due(self) -> float | None:
        return self.inbox.next_due()

    # ---- load figures for routers (policies.routing.InstanceLoad) -------------------------
    def _outside(self) -> list[Request]:
        """Requests submitted but not yet taken in, and offered KV transfers (other threads may
        be adding to both: copied first)."""
        return self.inbox.requests() + [req for req, _ in list(self.pending)]

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work and not self.inbox and not self.pending

    # ---- the loop ------------------------------------------------------------------------
    def take_kv(self, fetch: Callable[[Any], object], *,
                on_error: Callable[[Request, Exception], None] | None = None,
                on_drop: Callable[[Request, Any], None] | None = None) -> int:
        """Take in the offered transfers that fit now (:meth:`admit_kv` reserves their blocks where
        the decode policy wants them: device, or the host pool for AlignedServe §3.2): import what
        ``fetch(payload)`` returns and hand each request to the scheduler. A failed fetch or import
        releases the reservation and goes to ``on_error`` (re-raised without one). Returns how
        many came in."""
        sched = self.scheduler
        in_host = sched.kv_lands_in_host
        taken = 0
        for req, payload in self.admit_kv(self.clock.now(), on_drop=on_drop):
            if not in_host and self._share_prompt(req, payload):
                req.times.transfer_end = self.clock.now()
                self.add_request(req, req.times.transfer_end)
                taken += 1
                continue
            try:
                self.executor.import_kv(req.request_id, fetch(payload), into_host=in_host)
            except Exception as exc:
                (sched.host_pool if in_host else sched.kv).free(req.request_id)
                if on_error is None:
                    raise
                on_error(req, exc)
                continue
            req.times.transfer_end = self.clock.now()
            self.add_request(req, req.times.transfer_end)
            taken += 1
        return taken

    def _share_prompt(self, req: Request, payload: Any) -> bool:
        """The samples of an n-sample request share one prompt KV (``payload`` has a ``leader``
        slot: the worker's shared transfer). The first sample admitted imports it and becomes the
        leader; each later one, while the leader still holds its blocks, gets the leader's full
        prompt blocks by reference (``KVCacheManager.fork``) and a copy of the partial last one,
        instead of an import of its own. Returns True when ``req`` got its KV that way."""
        if not hasattr(payload, "leader"):
            return False
        kv, rid = self.scheduler.kv, req.request_id
        leader = payload.leader
        if leader is None or leader not in kv.tables or kv.num_allocated(leader) * kv.block_size < req.num_computed_tokens:
            payload.leader = rid                 # this one imports: later samples fork from it
            return False
        kv.free(rid)                             # the reservation: the fork takes what it needs
        copy = kv.fork(leader, rid, req.num_computed_tokens)
        if copy is not None:
            self.executor.copy_block(copy)
        payload.drop()
        self.kv_forks += 1
        return True

    def release_dropped(self) -> int:
        """Free the executor state of preempted plans the scheduler gave up (a member was
        aborted: FlowPrefill lists them in ``dropped_plans``). Returns how many were parked."""
        dropped = self.scheduler.dropped_plans
        freed = 0
        while dropped:
            freed += bool(self.executor.discard(dropped.pop()))
        return freed

    def step(self) -> StepOutcome | None:
        """Run one step if the scheduler has one; ``None`` when it has nothing to run now."""
        self.release_dropped()
        self.take_arrivals()
        plan = self.schedule(self.clock.now())
        if plan is None:
            return None
        should_stop = self._preempt_check(plan) if plan.preemptible else None
        result = self.executor.execute(plan, should_stop)    # raises: self.plan names the failed step
        end = self.clock.now()
        outcome = self.update(plan, result, end, result.duration)
        self.failed = dict(getattr(result, "failed", None) or {})
        for rid in self.failed:                        # a row that could not be sampled: fail it alone
            req = self.scheduler.abort(rid, end, reason="error")
            for done in (outcome.finished, outcome.prefilled):
                if req is not None and req in done:
                    done.remove(req)
        if self.stop_checker is not None and result.completed:
            self._apply_stop_strings(plan, end, outcome)
        return outcome

    def _preempt_check(self, plan: StepPlan) -> Callable[[], bool]:
        def should_stop() -> bool:
            if not self.take_arrivals():
                wake = self.scheduler.next_wakeup()     # a policy deadline (suspension bound)
                if wake is None or self.clock.now() < wake:
                    return False
            return self.preempt_wanted(self.clock.now())
        return should_stop

    def _apply_stop_strings(self, plan: StepPlan, now: float, outcome: StepOutcome) -> None:
        reqs = [c.request for c in plan.prefills] + plan.decodes
        for req in reqs:
            params = req.sampling
            if req.is_finished or params is None or not params.stop or not req.output_token_ids:
                continue
            if params.n > 1 and req.num_output_tokens == 1:    # an n-sample request's samples fork first
                continue
            if self.stop_checker.check(req.output_token_ids, params) is not None:
                self.scheduler.abort(req.request_id, now, reason="stop")
                outcome.finished.append(req)
                if req in outcome.prefilled:
                    outcome.prefilled.remove(req)

    def run_until_idle(self, *, max_steps: int | None = None,
                       on_finish: Callable[[Request], None] | None = None) -> int:
        """Drive the loop until nothing is queued or due; waits (sleeps) for future arrivals.
        Returns the number of steps run. Raises if the scheduler stalls with work left."""
        import time
        steps = 0
        while not self.idle:
            outcome = self.step()
            if outcome is None:
                due = self.next_due()
                wake = self.scheduler.next_wakeup()
                targets = [t for t in (due, wake) if t is not None]
                if not targets:
                    raise RuntimeError(f"instance {self.instance_id} stalled with work left: "
                                       f"{self.scheduler.num_waiting} waiting, {self.scheduler.num_running} running")
                delay = min(targets) - self.clock.now()
                if delay > 0:
                    time.sleep(min(delay, 0.05))
                continue
            steps += 1
            if on_finish is not None:
                for req in outcome.finished:
                    on_finish(req)
            if max_steps is not None and steps >= max_steps:
                break
        return steps
