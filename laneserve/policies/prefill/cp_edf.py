"""Chunked prefill with earliest-deadline-first ordering (the CP-EDF baseline of FlowPrefill §6).

Each step fills a fixed chunk budget (2048 or 8192 tokens in the paper) with prompt tokens taken
in order of TTFT deadline; the last request may take a partial chunk and continues next step. A
request whose KV does not fit is skipped for this step (order is not admission).
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass

from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.policies.options import at_least, default_to
from laneserve.policies.prefill.base import PrefillOptions, PrefillScheduler
from laneserve.policies.registry import register


def _edf_key(req: Request) -> tuple[float, float, int]:
    return (req.ttft_deadline, req.arrival_time, req.request_id)


@dataclass(frozen=True, slots=True)
class ChunkedEDFOptions(PrefillOptions):
    token_budget: int | None = None     # None: the chunk
    chunk: int = 2048                   # prompt tokens per step

    def validate(self) -> None:
        at_least(self, "chunk", 1)
        default_to(self, "token_budget", "chunk")
        PrefillOptions.validate(self)


@register("prefill", "cp-edf", aliases={"cp-edf-2k": {"chunk": 2048}, "cp-edf-8k": {"chunk": 8192},
                                         "cp2k": {"chunk": 2048}, "cp8k": {"chunk": 8192}})
class ChunkedEDFPrefill(PrefillScheduler):
    name = "cp-edf"
    Options = ChunkedEDFOptions
    options: ChunkedEDFOptions

    def __init__(self, kv, options: ChunkedEDFOptions | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        self.chunk_size = self.options.chunk
        self.name = f"cp-edf-{self.chunk_size}"
        self.queue: list[Request] = []

    def _push(self, req: Request, now: float) -> None:
        insort(self.queue, req, key=_edf_key)

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        if not self.queue:
            return None
        plan = StepPlan(label=self.name)
        # colocated: the step's budget left after its decodes, never more than the chunk
        budget = self.chunk_size if token_budget is None else min(self.chunk_size, token_budget)
        for req in self.queue:
            if budget <= 0 or len(plan.prefills) >= self.max_batch_size:
                break
            if not self.admit(req, now):
                continue
            chunk = self.chunk(req, budget)
            plan.prefills.append(chunk)
            budget -= chunk.num_new_tokens
        return plan if plan.prefills else None
