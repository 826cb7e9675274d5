"""FlowPrefill (``flowprefill.txt`` §5): S-EDF priorities, event-driven scheduling (Algorithm 2),
SLO-aware batching under a token budget G (Algorithm 1) and operator-level preemption (§5.1).

Mapping onto the scheduler contract (policies/base.py):

- Algorithm 2 runs on the two events the paper names. On an *arrival* while a preemptible step
  runs, the instance loop asks :meth:`should_preempt`: rank ``waiting ∪ preempted ∪ {running}``;
  True when the top is not the running task. The executor then stops at the next operator (or
  layer) boundary and calls ``update(completed=False)``; the task is parked (``Q_p``) with its plan.
  On a *completion* (or right after a preemption) :meth:`schedule` ranks ``waiting ∪ preempted``:
  a parked top is resumed by returning the same :class:`StepPlan` object (the executor continues
  from ``plan.ops_done``); a waiting top ``H`` is batched by Algorithm 1 and submitted.
- A task's priority is its head's, with the head's token count set to the batch's remaining
  tokens (Algorithm 1 line 11): slack = deadline − now − (TTFT̂(batch tokens) − time already run).
- Algorithm 1 walks the other waiting requests in priority order and adds ``r`` when the predicted
  latency of the grown batch is below the head's remaining time and the batch stays under G
  (strict inequalities, as printed); it keeps scanning after a rejection.
- Bound on every suspension (docs/design.md): a task parked for ``max_suspension`` seconds is resumed
  ahead of any priority; :meth:`next_wakeup` names that moment so the loop asks
  :meth:`should_preempt` even without an arrival. A task resumed this way is not preempted for
  priority again (only for another overdue task), so a suspension lasts at most
  ``max_suspension`` plus one preemption unit (an operator, a layer, or a chunk step).
- ``preemption="chunk"``: prompts run in ``chunk``-token steps (a step never exceeds ``chunk``
  tokens) and priorities are re-ranked between steps; nothing stops inside a step.
  ``preemption="none"``: plans are not preemptible (ablation).

Ablations (options or aliases): ``ordering`` sedf | dedf | edf | fcfs; ``batching=False``;
``token_budget`` (G; default 4096, the paper's "moderate" budget of Figure 11); ``preemption``
operator | layer | chunk | none. The TTFT predictor is ``predictor=`` (a fitted
:class:`~laneserve.costmodel.PolynomialTTFT`), else fitted to ``cost_model=`` or to the cost model
the simulator binds (:meth:`bind_cost_model`), else learned online from step durations.

Aborting a member of a parked batch discards the batch: its other members go back to waiting and
the plan is listed in :attr:`dropped_plans` (an engine loop should ``executor.discard`` it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Phase, Request
from laneserve.policies.base import StepOutcome
from laneserve.policies.options import above, at_least
from laneserve.policies.prefill.base import PrefillOptions, PrefillScheduler
from laneserve.policies.prefill.priority import (ORDERINGS, Ordering, PriorityKey, make_predictor,
                                                 never_negative, nondecreasing)
from laneserve.policies.prefill.sedf_queue import SignedDeadlineQueue
from laneserve.policies.registry import register

Granularity = Literal["operator", "layer", "chunk", "none"]
GRANULARITIES = get_args(Granularity)


@dataclass(frozen=True, slots=True)
class FlowPrefillOptions(PrefillOptions):
    token_budget: int = 4096              # G, the paper's "moderate" budget (Figure 11)
    ordering: Ordering = "sedf"
    batching: bool = True                 # Algorithm 1 (False: one request per step)
    preemption: Granularity = "operator"
    chunk: int = 2048                     # step size with preemption="chunk"
    max_suspension: float = 10.0          # seconds a parked task may wait before it is resumed

    def validate(self) -> None:
        PrefillOptions.validate(self)
        at_least(self, "chunk", 1)
        above(self, "max_suspension", 0)


@dataclass(slots=True, eq=False)
class PrefillTask:
    """One execution task of the Execution Pool (§4): a submitted batch and its progress."""

    plan: StepPlan
    head: Request
    tokens: int                      # new tokens of the batch (H.num_tokens after Algorithm 1)
    predicted: float                 # TTFT̂(tokens) when submitted
    run_since: float = 0.0           # start of the current run
    executed: float = 0.0            # seconds run before the current run
    suspended_at: float | None = None
    forced: bool = False             # resumed by the suspension bound

    def remaining(self, now: float, running: bool) -> float:
        done = self.executed + (now - self.run_since if running else 0.0)
        return self.predicted - done if self.predicted > done else 0.0


@register("prefill", "sedf", aliases={
    "flowprefill": {}, "s-edf": {},
    "dedf": {"ordering": "dedf"}, "d-edf": {"ordering": "dedf"},
    "edf": {"ordering": "edf"}, "naive-edf": {"ordering": "edf"},
    "sedf-nobatch": {"batching": False},
    "sedf-g2k": {"token_budget": 2048}, "sedf-g4k": {"token_budget": 4096}, "sedf-g8k": {"token_budget": 8192},
    "sedf-layer": {"preemption": "layer"}, "sedf-chunk": {"preemption": "chunk"},
    "sedf-nopreempt": {"preemption": "none"},
})
class FlowPrefillScheduler(PrefillScheduler):
    name = "sedf"
    Options = FlowPrefillOptions
    options: FlowPrefillOptions

    def __init__(self, kv, options: FlowPrefillOptions | None = None, *, predictor: Any = None,
                 cost_model: Any = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        self.ordering = o.ordering
        self._key = ORDERINGS[o.ordering]
        self.batching = o.batching
        self.preemption = o.preemption
        self.chunk_size = o.chunk
        self.max_suspension = o.max_suspension
        self.predict, self._online = make_predictor(predictor, cost_model)
        self.name = (f"{o.ordering}" + ("" if o.batching else "-nobatch") + f"-g{o.token_budget}"
                     + ("" if o.preemption == "operator" else f"-{o.preemption}"))
        self.waiting: dict[int, Request] = {}          # Q_w: requests in no task
        self.parked: dict[int, PrefillTask] = {}       # Q_p: plan_id -> preempted task
        self.running: PrefillTask | None = None        # E
        self.num_preemptions = 0
        self.num_forced_resumes = 0
        self.suspensions: list[float] = []             # how long each resumed task was parked
        self._queue = SignedDeadlineQueue(o.ordering, self.predict, self._step_tokens)
        self._monotone_memo: tuple[Any, bool] = (None, False)

    def bind_cost_model(self, cost_model: Any) -> None:
        """Fit the TTFT polynomial to the instance's cost model unless a predictor was given."""
        if self._online:
            self.predict, self._online = make_predictor(None, cost_model)
            self._queue.set_predictor(self.predict)

    # ---- queues ----------------------------------------------------------------------------
    def _push(self, req: Request, now: float) -> None:
        self._wait(req)

    def _wait(self, req: Request) -> None:
        self.waiting[req.request_id] = req
        self._queue.add(req)

    def _unwait(self, request_id: int) -> None:
        self.waiting.pop(request_id, None)
        self._queue.discard(request_id)

    def _remove(self, req: Request) -> None:
        self._unwait(req.request_id)
        for pid, task in list(self.parked.items()):
            if any(c.request is req for c in task.plan.prefills):
                del self.parked[pid]
                self.dropped_plans.append(task.plan)
                for c in task.plan.prefills:
                    if c.request is not req and c.request.request_id in self.pending:
                        c.request.phase = Phase.PREFILLING
                        self._wait(c.request)

    @property
    def num_running(self) -> int:
        return 0 if self.running is None else len(self.running.plan.prefills)

    # ---- ranking ---------------------------------------------------------------------------
    def _waiting_ranked(self, now: float) -> Iterator[tuple[PriorityKey, Request]]:
        """Waiting requests with their keys, best first, lazily (removals during the walk are
        fine)."""
        self._queue.advance(now)
        return self._queue.ordered()

    def _waiting_best_key(self, now: float) -> PriorityKey | None:
        self._queue.advance(now)
        top = self._queue.top()
        return None if top is None else top[0]

    def _batch_closed(self, tokens: int, limit: int, t_remain: float) -> bool:
        """No waiting request can join a batch of ``tokens`` any more (Algorithm 1 would reject
        every one): none is short enough for the budget, or the head has no time left."""
        if t_remain <= 0.0 and never_negative(self.predict):
            return True
        least = self._queue.min_remaining()
        if least is None or tokens + least >= limit:
            return True
        # a predictor that cannot decrease rejects every longer batch too (the margin absorbs
        # the rounding of its float evaluation)
        return self.predict(tokens + least) >= t_remain + 1e-9 * (abs(t_remain) + 1.0) \
            and self._monotone(limit)

    def _monotone(self, limit: int) -> bool:
        version = (self.predict, getattr(self.predict, "version", None), limit)
        if self._monotone_memo[0] != version:
            self._monotone_memo = (version, nondecreasing(self.predict, float(limit)))
        return self._monotone_memo[1]

    def _req_key(self, req: Request, now: float) -> PriorityKey:
        return self._key(req, now, self.predict(self._step_tokens(req)))

    def _task_key(self, task: PrefillTask, now: float, running: bool) -> PriorityKey:
        return self._key(task.head, now, task.remaining(now, running))

    def _step_tokens(self, req: Request) -> int:
        n = self.new_tokens(req)
        return min(n, self.chunk_size) if self.preemption == "chunk" else n

    def _overdue(self, now: float) -> PrefillTask | None:
        """The longest-parked task whose suspension bound has expired."""
        best = None
        for task in self.parked.values():
            if now >= task.suspended_at + self.max_suspension and (     # same float as next_wakeup
                    best is None or task.suspended_at < best.suspended_at):
                best = task
        return best

    def next_wakeup(self) -> float | None:
        if not self.parked:
            return None
        return min(t.suspended_at for t in self.parked.values()) + self.max_suspension

    # ---- Algorithm 2: the arrival event while a task runs ----------------------------------
    def should_preempt(self, running: StepPlan, now: float) -> bool:
        task = self.running
        if task is None or task.plan is not running or self.preemption in ("chunk", "none"):
            return False
        if self._overdue(now) is not None:
            return True
        if task.forced:
            return False
        top = self._task_key(task, now, True)
        if any(self._task_key(t, now, False) < top for t in self.parked.values()):
            return True
        best = self._waiting_best_key(now)
        return best is not None and best < top

    # ---- Algorithm 2: the completion event (and after a preemption) ------------------------
    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        overdue = self._overdue(now)
        if overdue is not None:
            self.num_forced_resumes += 1
            return self._resume(overdue, now, forced=True)
        parked = min(((self._task_key(t, now, False), t) for t in self.parked.values()),
                     key=lambda item: item[0], default=None)
        budget = self.token_budget if token_budget is None else token_budget
        walk = self._waiting_ranked(now)
        for key, req in walk:                 # waiting requests merged with the best parked task
            if parked is not None and parked[0] < key:
                return self._resume(parked[1], now, forced=False)
            if self.admit(req, now):
                return self._submit(req, key, walk, now, budget)
        if parked is not None:
            return self._resume(parked[1], now, forced=False)
        return None        # nothing fits in KV memory now; a completion will free some

    def _resume(self, task: PrefillTask, now: float, *, forced: bool) -> StepPlan:
        del self.parked[task.plan.plan_id]
        self.suspensions.append(now - task.suspended_at)
        task.suspended_at = None
        task.run_since = now
        task.forced = forced
        for c in task.plan.prefills:
            c.request.phase = Phase.PREFILLING
        self.running = task
        return task.plan

    def _candidates(self, walk: Iterator[tuple[PriorityKey, Request]], head_key: PriorityKey,
                    bound: Callable[[], int]) -> Iterable[Request]:
        """Algorithm 1's candidates after the head, in priority order; those whose remaining
        tokens are at or above ``bound()`` (which Algorithm 1 would reject) may be left out."""
        return self._queue.ordered_below(head_key, bound)

    def _fit_cutoff(self, tokens: int, limit: int, t_remain: float) -> int:
        """A batch size (tokens) that Algorithm 1 rejects, and every larger one too: ``limit``, or
        less when the predictor cannot decrease — the first size predicted to take ``t_remain``
        or more (binary search; the margin absorbs the rounding of the float evaluation)."""
        if not self._monotone(limit):
            return limit
        margin = t_remain + 1e-9 * (abs(t_remain) + 1.0)
        lo, hi = tokens + 1, limit            # invariant: hi == limit or predict(hi) >= margin
        while lo < hi:
            mid = (lo + hi) // 2
            if self.predict(mid) >= margin:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _submit(self, head: Request, head_key: PriorityKey, walk: Iterator[tuple[PriorityKey, Request]],
                now: float, budget: int) -> StepPlan:
        """Algorithm 1 (SLO-aware batching) for head ``H`` over the waiting requests ranked after it."""
        cap = self.chunk_size if self.preemption == "chunk" else None
        n_head = head.remaining_prefill if cap is None else min(head.remaining_prefill, cap)
        plan = StepPlan(label=self.name, preemptible=self.preemption != "none",
                        preempt_granularity=self.preemption if self.preemption != "none" else "operator")
        plan.prefills.append(self.chunk(head, n_head))
        self._unwait(head.request_id)
        tokens = n_head
        if self.batching:
            t_remain = head.ttft_deadline - now
            limit = budget if cap is None else min(budget, cap + 1)
            cutoff = self._fit_cutoff(tokens, limit, t_remain)
            # late binding wanted: the walk reads the tokens taken so far
            for r in self._candidates(walk, head_key, lambda: cutoff - tokens):  # noqa: B023
                if len(plan.prefills) >= self.max_batch_size or self._batch_closed(tokens, limit, t_remain):
                    break
                n = tokens + self.new_tokens(r)
                if n < limit and t_remain > self.predict(n) and self._may_join(head, r) and self.admit(r, now):
                    plan.prefills.append(self.chunk(r, r.remaining_prefill))
                    self._unwait(r.request_id)
                    tokens = n
        self.running = PrefillTask(plan, head, tokens, self.predict(tokens), run_since=now)
        return plan

    def _may_join(self, head: Request, req: Request) -> bool:
        """Whether Algorithm 1 may batch ``req`` with ``head`` at all (a hook: ``adaptive``
        keeps LAPS' lanes apart)."""
        return True

    # ---- results ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        task = self.running
        if task is not None and task.plan is plan:
            self.running = None
        if not result.completed:
            if task is None or task.plan is not plan:
                raise RuntimeError(f"{self.name}: a plan it is not running was preempted")
            task.executed += now - task.run_since
            task.suspended_at = now
            task.forced = False
            self.parked[plan.plan_id] = task
            self.num_preemptions += 1
            for c in plan.prefills:
                c.request.num_preemptions += 1
        elif self._online and task is not None and task.executed == 0.0:
            self.predict.observe(plan.num_prefill_tokens, result.duration)   # type: ignore[attr-defined]
        return super().update(plan, result, now)

    def _after_update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        super()._after_update(plan, outcome, now)
        for c in plan.prefills:          # chunk granularity: the rest of the prompt waits again
            req = c.request
            if not req.prefill_done and req.request_id in self.pending:
                self._wait(req)
