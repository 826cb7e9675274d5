"""FCFS continuous batching (the vLLM baseline): every step decodes all running requests; new
requests join in arrival order while batch slots and KV memory allow; when memory runs out the
newest running request is preempted (swap to the host pool, or recompute)."""

from __future__ import annotations

from laneserve.core.plan import StepPlan
from laneserve.policies.decode.base import DecodeOptions, DecodeScheduler
from laneserve.policies.registry import register


@register("decode", "continuous", aliases={"cb": {}, "fcfs": {}, "vllm": {}})
class ContinuousBatchingDecode(DecodeScheduler):
    name = "continuous"
    stable_decode_batch = True
    Options = DecodeOptions

    def schedule(self, now: float) -> StepPlan | None:
        plan = self._prepare_step(now)
        plan.decodes = list(self.running)
        return None if plan.is_empty else plan
