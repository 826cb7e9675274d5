"""FCFS continuous batching (the vLLM baseline): every step decodes all running requests; new
requests join in arrival order while batch slots and KV memory allow; when memory runs out the
newest running request is preempted (swap to the host pool, or recompute)."""

from __future__ import annotations

from laneserve.core.plan import StepPlan
from laneserve.policies.decode.base import DecodeScheduler
from laneserve.policies.registry import register


@register("decode", "continuous", aliases={"cb": {}, "fcfs": {}, "vllm": {}})
class ContinuousBatchingDecode(DecodeScheduler):
    name = "continuous"

    def schedule(self, now: float) -> StepPlan | None:
        plan = StepPlan(label=self.name)
        self._grow_running(plan)
        self._readmit_parked(plan, now)
        kv, waiting, running = self.kv, self.waiting, self.running
        while True:
            # waiting requests hold their KV already: they never wait behind parked ones
            while waiting and len(running) < self.max_batch_size:
                req = waiting[0]
                if not kv.can_grow(req.request_id, req.context_len):
                    break
                waiting.popleft()
                self._admit(req, now)
            if not self._unstick(plan):
                break
        plan.decodes = list(running)
        return None if plan.is_empty else plan
