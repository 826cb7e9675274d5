"""S-EDF ordering of a prefill instance's waiting requests (FlowPrefill §5.2): the component
:class:`SEDFOrdering`, held as ``self.ordering`` by both ``sedf`` (:mod:`..sedf`) and
``adaptive`` (:mod:`..adaptive`).

It owns the waiting set ``Q_w`` (requests in no task), the TTFT predictor and the incremental
priority queue over them (:class:`~.sedf_queue.SignedDeadlineQueue`), and answers what the
other two mechanisms ask of an ordering:

- :meth:`ranked` / :meth:`best_key`: the waiting requests best first, or only the best key
  (Algorithm 2 merges them with the parked tasks, :mod:`.sedf_tasks`);
- :meth:`req_key` / :meth:`task_key`: the key of a request or of a task
  (``slack = deadline − now − TTFT̂(tokens left)``, or the D-EDF / EDF / FCFS ablations);
- :meth:`candidates`, :meth:`fit_cutoff`, :meth:`batch_closed`: what Algorithm 1
  (:mod:`.slo_batching`) walks, and when it may stop walking.

The step tokens a request is predicted by are its remaining new tokens, capped at ``chunk`` when
prompts run in chunk steps. A form that re-sorts every decision (``ScanSEDFOrdering`` in
``tests/policy_references.py``) is checked against this one step for step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from laneserve.core.request import Request
from laneserve.policies.prefill.mechanisms.priority import (ORDERINGS, Ordering, PriorityKey, make_predictor,
                                                            never_negative, nondecreasing)
from laneserve.policies.prefill.mechanisms.sedf_queue import SignedDeadlineQueue


class SEDFOrdering:
    """The waiting requests of a prefill instance in S-EDF (or ablation) priority order.

    ``host`` is the scheduler holding it (:class:`~..base.PrefillScheduler`): it reads the new
    tokens of a request from it (prefix-cache aware). ``chunk`` caps the step tokens (``None``:
    whole prompts)."""

    def __init__(self, host: Any, ordering: Ordering, *, chunk: int | None = None,
                 predictor: Any = None, cost_model: Any = None) -> None:
        self.host = host
        self.name = ordering
        self.chunk = chunk
        self._key = ORDERINGS[ordering]
        self.predict, self.online = make_predictor(predictor, cost_model)
        self.waiting: dict[int, Request] = {}          # Q_w: requests in no task
        self.queue = SignedDeadlineQueue(ordering, self.predict, self.step_tokens)
        self._monotone_memo: tuple[Any, bool] = (None, False)

    def bind_cost_model(self, cost_model: Any) -> None:
        """Fit the TTFT polynomial to the instance's cost model unless a predictor was given."""
        if self.online:
            self.predict, self.online = make_predictor(None, cost_model)
            self.queue.set_predictor(self.predict)

    def step_tokens(self, req: Request) -> int:
        n = self.host.new_tokens(req)
        return min(n, self.chunk) if self.chunk is not None else n

    # ---- the waiting set -------------------------------------------------------------------
    def wait(self, req: Request) -> None:
        self.waiting[req.request_id] = req
        self.queue.add(req)

    def unwait(self, request_id: int) -> None:
        self.waiting.pop(request_id, None)
        self.queue.discard(request_id)

    # ---- ranking ---------------------------------------------------------------------------
    def ranked(self, now: float) -> Iterator[tuple[PriorityKey, Request]]:
        """Waiting requests with their keys, best first, lazily (removals during the walk are
        fine)."""
        self.queue.advance(now)
        return self.queue.ordered()

    def best_key(self, now: float) -> PriorityKey | None:
        self.queue.advance(now)
        top = self.queue.top()
        return None if top is None else top[0]

    def req_key(self, req: Request, now: float) -> PriorityKey:
        return self._key(req, now, self.predict(self.step_tokens(req)))

    def task_key(self, task: Any, now: float, running: bool) -> PriorityKey:
        """The key of a task (:class:`~.sedf_tasks.PrefillTask`): its head's, with the
        predicted time the task has left."""
        return self._key(task.head, now, task.remaining(now, running))

    # ---- what Algorithm 1 walks ------------------------------------------------------------
    def candidates(self, walk: Iterator[tuple[PriorityKey, Request]], head_key: PriorityKey,
                   bound: Callable[[], int], fresh_bound: Callable[[], float] | None = None) -> Iterable[Request]:
        """Algorithm 1's candidates after the head, in priority order; those whose remaining
        tokens are at or above ``bound()`` (which Algorithm 1 would reject), and those not
        started at or above ``fresh_bound()`` (which find no KV memory), may be left out."""
        return self.queue.ordered_below(head_key, bound, fresh_bound=fresh_bound)

    def admissible(self, walk: Iterator[tuple[PriorityKey, Request]], after: PriorityKey,
                   fresh_bound: Callable[[], float]) -> Iterator[tuple[PriorityKey, Request]]:
        """The rest of ``walk`` (ranked after ``after``) where those not started at or above
        ``fresh_bound()`` tokens (which find no KV memory) may be left out."""
        return self.queue.ordered_admissible(after, fresh_bound)

    def batch_closed(self, tokens: int, limit: int, t_remain: float) -> bool:
        """No waiting request can join a batch of ``tokens`` any more (Algorithm 1 would reject
        every one): none is short enough for the budget, or the head has no time left."""
        if t_remain <= 0.0 and never_negative(self.predict):
            return True
        least = self.queue.min_remaining()
        if least is None or tokens + least >= limit:
            return True
        # a predictor that cannot decrease rejects every longer batch too (the margin absorbs
        # the rounding of its float evaluation)
        return self.predict(tokens + least) >= t_remain + 1e-9 * (abs(t_remain) + 1.0) \
            and self.monotone(limit)

    def monotone(self, limit: int) -> bool:
        version = (self.predict, getattr(self.predict, "version", None), limit)
        if self._monotone_memo[0] != version:
            self._monotone_memo = (version, nondecreasing(self.predict, float(limit)))
        return self._monotone_memo[1]

    def fit_cutoff(self, tokens: int, limit: int, t_remain: float) -> int:
        """A batch size (tokens) that Algorithm 1 rejects, and every larger one too: ``limit``, or
        less when the predictor cannot decrease — the first size predicted to take ``t_remain``
        or more (binary search; the margin absorbs the rounding of the float evaluation)."""
        if not self.monotone(limit):
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
