"""FCFS prefill (the DistServe baseline): whole prompts in arrival order, batched while the
step's new tokens stay within the token budget. The head of the queue waits for KV memory
rather than being overtaken (head-of-line blocking is the behaviour under study)."""

from __future__ import annotations

from collections import deque

from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.policies.prefill.base import PrefillOptions, PrefillScheduler
from laneserve.policies.registry import register


@register("prefill", "fcfs")
class FCFSPrefill(PrefillScheduler):
    name = "fcfs"
    Options = PrefillOptions

    def __init__(self, kv, options: PrefillOptions | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        self.queue: deque[Request] = deque()

    def _push(self, req: Request, now: float) -> None:
        self.queue.append(req)

    def _remove(self, req: Request) -> None:
        if req.times.prefill_start is None:      # admitted requests left the queue when they started
            super()._remove(req)

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        budget = self.token_budget if token_budget is None else token_budget
        queue = self.queue
        if not queue:
            return None
        plan = StepPlan(label=self.name)
        tokens = 0
        while queue and len(plan.prefills) < self.max_batch_size:
            req = queue[0]
            n = req.remaining_prefill
            if plan.prefills and tokens + n > budget:
                break
            if not self.admit(req, now):
                break
            queue.popleft()
            plan.prefills.append(self.chunk(req, n))
            tokens += n
        return plan if plan.prefills else None
