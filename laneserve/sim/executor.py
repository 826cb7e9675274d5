"""The simulated executor: a step takes as long as the cost model says. Preemptible prefills are
charged operator by operator, so a preempted step resumes with the operators it has left."""

from __future__ import annotations

from laneserve.core.plan import StepPlan, StepResult
from laneserve.costmodel.base import LAYER_OPERATORS, CostModel, graphed_prefill_time

OPS_PER_LAYER = len(LAYER_OPERATORS)


class SimExecutor:
    def __init__(self, cost: CostModel, *, swap_link: str = "pcie") -> None:
        self.cost = cost
        self.swap_link = swap_link

    def execute(self, plan: StepPlan) -> StepResult:
        cost = self.cost
        if plan.prefills:
            batch = plan.prefill_batch()
            if plan.decodes:
                duration = cost.mixed_step_time(batch, [r.prompt_len + r.num_output_tokens for r in plan.decodes])
            elif plan.preemptible:
                if plan.op_times is None:
                    plan.op_times = cost.prefill_op_times(batch)
                duration = sum(plan.op_times[plan.ops_done:])
            elif plan.padded_shape is not None:     # a captured shape bucket: graph replay
                duration = graphed_prefill_time(cost, batch)
            else:
                duration = cost.prefill_time(batch)
        elif plan.decodes:
            duration = cost.decode_step_time([r.prompt_len + r.num_output_tokens for r in plan.decodes])
        else:
            duration = 0.0
        for copy in plan.swap_in:
            duration += cost.kv_transfer_time(copy.num_tokens, self.swap_link)
        for copy in plan.swap_out:
            duration += cost.kv_transfer_time(copy.num_tokens, self.swap_link)
        return StepResult(duration=duration)

    @staticmethod
    def boundaries(plan: StepPlan) -> list[int]:
        """Operator counts (from ``plan.ops_done``) at which the running step may stop, by the
        plan's granularity: every operator, every layer end, or none ("chunk": whole steps)."""
        if plan.op_times is None or plan.preempt_granularity == "chunk":
            return []
        total = len(plan.op_times)
        start = plan.ops_done
        if plan.preempt_granularity == "layer":
            return [k for k in range(start + 1, total) if k % OPS_PER_LAYER == 0]
        return list(range(start + 1, total))
