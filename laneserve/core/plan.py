"""Plans and results: what a scheduler asks an executor to run, and what came back.

``plan = scheduler.schedule(now); result = executor.execute(plan); scheduler.update(plan, result,
now)`` — the executor is the only part that differs between the engine (torch) and the simulator
(cost model). A plan that is ``preemptible`` may be stopped at an operator boundary
(FlowPrefill §4); the executor then returns ``result.completed = False`` with the progress kept on
the plan (``ops_done``), and submitting the same plan object again resumes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from laneserve.core.kv import BlockCopy
from laneserve.core.request import Request

_plan_ids = count()


@dataclass(slots=True)
class PrefillChunk:
    """Compute tokens ``[start, start + num_new_tokens)`` of ``request``; the tokens before
    ``start`` already have KV (earlier chunks or a cached prefix). Usually prompt tokens; a
    recompute after preemption also covers output tokens (``PrefillChunk(req, 0, context_len - 1)``)."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_new_tokens >= self.request.prompt_len


@dataclass(slots=True, eq=False)
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)
    #: (tokens per request, batch size) a short-prefill batch is padded to (LAPS shape buckets)
    padded_shape: tuple[int, int] | None = None
    #: the executor may stop this step at an operator boundary when asked
    preemptible: bool = False
    #: preemption granularity the executor honours: "operator" | "layer" | "chunk"
    preempt_granularity: str = "operator"
    #: executor-owned progress of a preemptible step (operators done / their durations)
    ops_done: int = 0
    op_times: list[float] | None = None
    plan_id: int = field(default_factory=lambda: next(_plan_ids))
    label: str = ""

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.swap_in or self.swap_out)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.prefills)

    def prefill_batch(self) -> list[tuple[int, int]]:
        """The ``(new_tokens, cached_tokens)`` pairs a cost model takes."""
        if self.padded_shape is not None:
            length, batch = self.padded_shape
            return [(length, c.start) for c in self.prefills] + [(length, 0)] * (batch - len(self.prefills))
        return [(c.num_new_tokens, c.start) for c in self.prefills]


@dataclass(slots=True)
class StepResult:
    """Outcome of executing (part of) a plan.

    ``duration`` is the time the step occupied the instance (measured in the engine, predicted in
    the simulator). ``completed`` is False when a preemptible step stopped at a boundary; the
    plan's ``ops_done`` then records how far it got. ``sampled`` maps request id to the sampled
    token id (engine only; the simulator samples nothing)."""

    duration: float
    completed: bool = True
    sampled: dict[int, int] | None = None
    stop_hit: set[int] | None = None   # engine: requests whose sampled token met a stop condition
