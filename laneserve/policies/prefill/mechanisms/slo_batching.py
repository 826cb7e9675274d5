"""SLO-aware batching under a token budget G (FlowPrefill §5, Algorithm 1): the component
:class:`SLOAwareBatching`, held as ``self.batcher`` by both ``sedf`` (:mod:`..sedf`) and
``adaptive`` (:mod:`..adaptive`).

For a head ``H`` (the best waiting request, chosen by Algorithm 2 in :mod:`.sedf_tasks`), it walks
the other waiting requests in priority order (:class:`~.sedf_ordering.SEDFOrdering`) and adds
``r`` when the predicted latency of the grown batch is below the head's remaining time and the
batch stays under G (strict inequalities, as printed); it keeps scanning after a rejection. With
``enabled=False`` a step holds the head alone (the ``sedf-nobatch`` ablation). With
``granularity="chunk"`` no step exceeds ``chunk`` tokens.

``lanes`` (optional) restricts who may join a head: ``adaptive`` passes its
:class:`~.bimodal_lanes.BimodalLanes`, which keeps short and long prompts apart while the recent
lengths are bimodal (LAPS' mutual exclusion); it then also says which candidates to walk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.policies.prefill.mechanisms.priority import INF, PriorityKey
from laneserve.policies.prefill.mechanisms.sedf_ordering import SEDFOrdering


class SLOAwareBatching:
    """Algorithm 1. ``host`` is the scheduler (:class:`~..base.PrefillScheduler`): KV admission,
    chunks, new tokens, ``max_batch_size`` and the plan label come from it."""

    def __init__(self, host: Any, ordering: SEDFOrdering, *, enabled: bool, granularity: str,
                 chunk: int, lanes: Any = None) -> None:
        self.host = host
        self.ordering = ordering
        self.enabled = enabled
        self.granularity = granularity
        self.chunk = chunk
        self.lanes = lanes

    def _candidates(self, head: Request, walk: Iterator[tuple[PriorityKey, Request]],
                    head_key: PriorityKey, bound: Callable[[], int],
                    fresh_bound: Callable[[], float]) -> Iterable[Request]:
        lanes = self.lanes
        if lanes is not None and lanes.bimodal:
            return lanes.candidates(self.ordering.queue, head, head_key, bound, fresh_bound)
        return self.ordering.candidates(walk, head_key, bound, fresh_bound)

    def submit(self, head: Request, head_key: PriorityKey, walk: Iterator[tuple[PriorityKey, Request]],
               now: float, budget: int) -> tuple[StepPlan, int]:
        """Algorithm 1 for head ``H`` over the waiting requests ranked after it: the step and
        its new tokens."""
        host, ordering, lanes = self.host, self.ordering, self.lanes
        granularity = self.granularity
        cap = self.chunk if granularity == "chunk" else None
        n_head = head.remaining_prefill if cap is None else min(head.remaining_prefill, cap)
        plan = StepPlan(label=host.name, preemptible=granularity != "none",
                        preempt_granularity=granularity if granularity != "none" else "operator")
        plan.prefills.append(host.chunk(head, n_head))
        ordering.unwait(head.request_id)
        tokens = n_head
        if self.enabled:
            t_remain = head.ttft_deadline - now
            limit = budget if cap is None else min(budget, cap + 1)
            cutoff = ordering.fit_cutoff(tokens, limit, t_remain)
            refused = INF      # a prompt this long found no KV: the not started as long are skipped
            # late binding wanted: the walk reads the tokens taken so far and the refusals
            for r in self._candidates(head, walk, head_key, lambda: cutoff - tokens,  # noqa: B023
                                      lambda: refused):                                # noqa: B023
                if len(plan.prefills) >= host.max_batch_size or ordering.batch_closed(tokens, limit, t_remain):
                    break
                n = tokens + host.new_tokens(r)
                if n < limit and t_remain > ordering.predict(n) and (lanes is None or lanes.may_join(head, r)):
                    if host.admit(r, now):
                        plan.prefills.append(host.chunk(r, r.remaining_prefill))
                        ordering.unwait(r.request_id)
                        tokens = n
                    elif (bound := host.refusal_bound(r)) is not None:
                        refused = min(refused, bound)
        return plan, tokens
