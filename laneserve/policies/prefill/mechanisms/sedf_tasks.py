"""FlowPrefill's Execution Pool with operator-level preemption (§4, §5.1) and its event-driven
scheduling (Algorithm 2): the component :class:`PreemptiveTasks`, held as ``self.tasks`` by both
``sedf`` (:mod:`..sedf`) and ``adaptive`` (:mod:`..adaptive`).

- On an *arrival* while a preemptible step runs, the instance loop asks :meth:`should_preempt`:
  rank ``waiting ∪ preempted ∪ {running}``; True when the top is not the running task. The
  executor then stops at the next operator (or layer) boundary and the scheduler's ``update``
  (``completed=False``) parks the task (``Q_p``) with its plan (:meth:`on_step`).
- On a *completion* (or right after a preemption) :meth:`schedule` ranks ``waiting ∪ preempted``:
  a parked top is resumed by returning the same :class:`StepPlan` object (the executor continues
  from ``plan.ops_done``); a waiting top ``H`` is batched by Algorithm 1
  (:class:`~.slo_batching.SLOAwareBatching`) and submitted.
- Bound on every suspension (docs/design.md): a task parked for ``max_suspension`` seconds is
  resumed ahead of any priority; :meth:`next_wakeup` names that moment. A task resumed this way
  is not preempted for priority again (only for another overdue task). With ``bound_late=False``
  (adaptive prefill's choice) the bound skips a task that is *late at its bound* (its key's slack
  negative at ``suspended_at + max_suspension``: it can no longer make its TTFT): such a task
  waits in priority order, as a late waiting request does, and runs when nothing that can still
  make its target waits, or when no waiting request can be admitted for KV memory (Algorithm 2
  then resumes the best parked task). Judged at the bound, not at the check, so the rule is a
  property of the parking episode and :meth:`next_wakeup` names exactly the resumes it forces.
  Each parked task holds its KV blocks and, on the engine, its activations, so the exemption
  holds only while at most ``late_parked_cap`` (16) tasks are parked: past that, late tasks past
  their bound are forced again, the longest-parked first.
- ``granularity="chunk"`` or ``"none"``: nothing is preempted inside a step.

The ranking is the ordering's (:class:`~.sedf_ordering.SEDFOrdering`): a task's key is its
head's, with the head's token count set to the batch's remaining time (Algorithm 1 line 11).
Aborting a member of a parked batch discards the batch (:meth:`drop`): its other members go back
to waiting and the plan is listed in the host's ``dropped_plans``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Phase, Request
from laneserve.policies.options import above, at_least
from laneserve.policies.prefill.base import PrefillOptions
from laneserve.policies.prefill.mechanisms.priority import INF, LATE, Ordering, PriorityKey
from laneserve.policies.prefill.mechanisms.sedf_ordering import SEDFOrdering
from laneserve.policies.prefill.mechanisms.slo_batching import SLOAwareBatching

Granularity = Literal["operator", "layer", "chunk", "none"]
GRANULARITIES = get_args(Granularity)


@dataclass(frozen=True, slots=True)
class SEDFMechanismOptions(PrefillOptions):
    """The options of S-EDF's components, declared once for every policy composed of them
    (``sedf``, adaptive prefill), with FlowPrefill's defaults."""

    token_budget: int = 4096              # G, the paper's "moderate" budget (Figure 11)
    ordering: Ordering = "sedf"
    batching: bool = True                 # Algorithm 1 (False: one request per step)
    preemption: Granularity = "operator"
    chunk: int = 2048                     # step size with preemption="chunk"
    max_suspension: float = 10.0          # seconds a parked task may wait before it is resumed
    bound_late: bool = True               # ...also a task already late at its bound (False: it waits in order)
    late_parked_cap: int = 16             # bound_late=False: past this many parked, late ones are bounded again

    def validate(self) -> None:
        PrefillOptions.validate(self)
        check_sedf_options(self)


def check_sedf_options(o: Any) -> None:
    """The checks of the options every S-EDF scheduler declares (``chunk``, ``max_suspension``,
    ``late_parked_cap``)."""
    at_least(o, "chunk", 1)
    above(o, "max_suspension", 0)
    at_least(o, "late_parked_cap", 0)


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
    exempt: bool = False             # while parked: late at its bound, exempt from it (bound_late=False)

    def remaining(self, now: float, running: bool) -> float:
        done = self.executed + (now - self.run_since if running else 0.0)
        return self.predicted - done if self.predicted > done else 0.0


class PreemptiveTasks:
    """The running task ``E`` and the parked tasks ``Q_p`` of one prefill instance, with
    Algorithm 2's two events. ``host`` is the scheduler (KV admission, ``pending``,
    ``dropped_plans``, its name)."""

    def __init__(self, host: Any, ordering: SEDFOrdering, batcher: SLOAwareBatching, *,
                 granularity: Granularity, max_suspension: float, bound_late: bool = True,
                 late_parked_cap: int = 16) -> None:
        self.host = host
        self.ordering = ordering
        self.batcher = batcher
        self.granularity = granularity
        self.max_suspension = max_suspension
        self.bound_late = bound_late
        self.late_parked_cap = late_parked_cap
        self.parked: dict[int, PrefillTask] = {}       # Q_p: plan_id -> preempted task
        self.running: PrefillTask | None = None        # E
        self.num_preemptions = 0
        self.num_forced_resumes = 0
        self.suspensions: list[float] = []             # how long each resumed task was parked

    @property
    def num_running(self) -> int:
        return 0 if self.running is None else len(self.running.plan.prefills)

    def drop(self, req: Request) -> None:
        """``req`` left the instance: a parked batch holding it is given up, its other members
        wait again."""
        host = self.host
        for pid, task in list(self.parked.items()):
            if any(c.request is req for c in task.plan.prefills):
                del self.parked[pid]
                host.dropped_plans.append(task.plan)
                for c in task.plan.prefills:
                    if c.request is not req and c.request.request_id in host.pending:
                        c.request.phase = Phase.PREFILLING
                        self.ordering.wait(c.request)

    def _due(self, task: PrefillTask, capped: bool) -> float | None:
        """When the suspension bound resumes ``task``: never while it is exempt (late at its
        bound, ``bound_late`` off), unless more than ``late_parked_cap`` tasks are parked
        (``capped``)."""
        return None if task.exempt and not capped else task.suspended_at + self.max_suspension

    def _overdue(self, now: float) -> PrefillTask | None:
        """The longest-parked task whose suspension bound has expired."""
        best = None
        capped = len(self.parked) > self.late_parked_cap
        for task in self.parked.values():
            due = self._due(task, capped)
            if due is not None and now >= due and (     # same float as next_wakeup
                    best is None or task.suspended_at < best.suspended_at):
                best = task
        return best

    def next_wakeup(self) -> float | None:
        capped = len(self.parked) > self.late_parked_cap
        return min((due for t in self.parked.values() if (due := self._due(t, capped)) is not None), default=None)

    # ---- Algorithm 2: the arrival event while a task runs ----------------------------------
    def should_preempt(self, running: StepPlan, now: float) -> bool:
        task = self.running
        if task is None or task.plan is not running or self.granularity in ("chunk", "none"):
            return False
        if self._overdue(now) is not None:
            return True
        if task.forced:
            return False
        ordering = self.ordering
        top = ordering.task_key(task, now, True)
        if any(ordering.task_key(t, now, False) < top for t in self.parked.values()):
            return True
        best = ordering.best_key(now)
        return best is not None and best < top

    # ---- Algorithm 2: the completion event (and after a preemption) ------------------------
    def schedule(self, now: float, budget: int) -> StepPlan | None:
        overdue = self._overdue(now)
        if overdue is not None:
            self.num_forced_resumes += 1
            return self._resume(overdue, now, forced=True)
        ordering = self.ordering
        parked = min(((ordering.task_key(t, now, False), t) for t in self.parked.values()),
                     key=lambda item: item[0], default=None)
        walk = ordering.ranked(now)
        heads: Iterator[tuple[PriorityKey, Request]] = walk     # merged with the best parked task
        refused = INF          # a prompt this long found no KV: the not started as long are skipped
        while (head := next(heads, None)) is not None:
            key, req = head
            if parked is not None and parked[0] < key:
                return self._resume(parked[1], now, forced=False)
            if self.host.admit(req, now):
                plan, tokens = self.batcher.submit(req, key, walk, now, budget)
                self.running = PrefillTask(plan, req, tokens, ordering.predict(tokens), run_since=now)
                return plan
            bound = self.host.refusal_bound(req)
            if bound is not None and bound < refused:
                if refused == INF:            # walk on without those that cannot be admitted
                    heads = ordering.admissible(walk, key, lambda: refused)  # noqa: B023 (read late)
                refused = bound
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

    # ---- results ---------------------------------------------------------------------------
    def on_step(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """A step ended (before the host advances its requests): a preempted task is parked; a
        completed first run teaches an online predictor."""
        task = self.running
        if task is not None and task.plan is plan:
            self.running = None
        if not result.completed:
            if task is None or task.plan is not plan:
                raise RuntimeError(f"{self.host.name}: a plan it is not running was preempted")
            task.executed += now - task.run_since
            task.suspended_at = now
            task.forced = False
            # fixed for the parking episode: a parked task's time left does not change, so
            # neither does its key's sign at the bound
            task.exempt = not self.bound_late and self.ordering.task_key(
                task, now + self.max_suspension, False)[0] == LATE
            self.parked[plan.plan_id] = task
            self.num_preemptions += 1
            for c in plan.prefills:
                c.request.num_preemptions += 1
        elif self.ordering.online and task is not None and task.executed == 0.0:
            self.ordering.predict.observe(plan.num_prefill_tokens, result.duration)   # type: ignore[attr-defined]

    def after_step(self, plan: StepPlan) -> None:
        """Chunk granularity: the rest of an unfinished prompt waits again."""
        pending = self.host.pending
        for c in plan.prefills:
            req = c.request
            if not req.prefill_done and req.request_id in pending:
                self.ordering.wait(req)


class SEDFWiring:
    """The scheduler side of S-EDF's components, for a prefill policy composed of them (mixed in
    before :class:`~..base.PrefillScheduler`: ``sedf`` and adaptive prefill). :meth:`compose_sedf`
    builds the ordering (``self.ordering``), SLO-aware batching (``self.batcher``, restricted to
    ``lanes`` when given) and the preemptible tasks (``self.tasks``); queues, Algorithm 2 and the
    step results are theirs. A policy adds only what is its own."""

    ordering: SEDFOrdering
    batcher: SLOAwareBatching
    tasks: PreemptiveTasks

    def compose_sedf(self, o: Any, ordering_class: type[SEDFOrdering] = SEDFOrdering, *, predictor: Any = None,
                     cost_model: Any = None, lanes: Any = None) -> None:
        self.preemption = o.preemption
        self.chunk_size = o.chunk
        self.max_suspension = o.max_suspension
        self.ordering = ordering_class(self, o.ordering, chunk=o.chunk if o.preemption == "chunk" else None,
                                       predictor=predictor, cost_model=cost_model)
        self.batcher = SLOAwareBatching(self, self.ordering, enabled=o.batching, granularity=o.preemption,
                                        chunk=o.chunk, lanes=lanes)
        self.tasks = PreemptiveTasks(self, self.ordering, self.batcher, granularity=o.preemption,
                                     max_suspension=o.max_suspension, bound_late=o.bound_late,
                                     late_parked_cap=o.late_parked_cap)

    def bind_cost_model(self, cost_model: Any) -> None:
        """Fit the TTFT polynomial to the instance's cost model unless a predictor was given."""
        self.ordering.bind_cost_model(cost_model)

    # ---- the components' state, as the scheduler's (tests, benchmarks) ----------------------
    @property
    def predict(self):
        return self.ordering.predict

    @property
    def waiting(self) -> dict[int, Request]:
        return self.ordering.waiting

    @property
    def parked(self) -> dict[int, PrefillTask]:
        return self.tasks.parked

    @property
    def running(self) -> PrefillTask | None:
        return self.tasks.running

    @property
    def num_preemptions(self) -> int:
        return self.tasks.num_preemptions

    @property
    def num_forced_resumes(self) -> int:
        return self.tasks.num_forced_resumes

    @property
    def suspensions(self) -> list[float]:
        return self.tasks.suspensions

    @property
    def _queue(self):
        return self.ordering.queue

    # ---- queues ----------------------------------------------------------------------------
    def _push(self, req: Request, now: float) -> None:
        self.ordering.wait(req)

    def _remove(self, req: Request) -> None:
        self.ordering.unwait(req.request_id)
        self.tasks.drop(req)

    @property
    def num_running(self) -> int:
        return self.tasks.num_running

    # ---- Algorithm 2 -----------------------------------------------------------------------
    def next_wakeup(self) -> float | None:
        return self.tasks.next_wakeup()

    def should_preempt(self, running: StepPlan, now: float) -> bool:
        return self.tasks.should_preempt(running, now)

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        return self.tasks.schedule(now, self.token_budget if token_budget is None else token_budget)

    # ---- results ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now: float):
        self.tasks.on_step(plan, result, now)
        return super().update(plan, result, now)

    def _after_update(self, plan: StepPlan, outcome: Any, now: float) -> None:
        super()._after_update(plan, outcome, now)
        self.tasks.after_step(plan)
