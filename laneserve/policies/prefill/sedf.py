"""FlowPrefill (the paper's §5): S-EDF priorities, event-driven scheduling (Algorithm 2),
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

Composition: the mechanisms live in components that ``adaptive`` prefill holds too, so this class
is only their wiring under :class:`~.base.PrefillScheduler` — ``self.ordering``
(:class:`~.mechanisms.sedf_ordering.SEDFOrdering`: ``Q_w``, the priorities, the predictor), ``self.batcher``
(:class:`~.mechanisms.slo_batching.SLOAwareBatching`: Algorithm 1) and ``self.tasks``
(:class:`~.mechanisms.sedf_tasks.PreemptiveTasks`: ``E``, ``Q_p``, Algorithm 2, the suspension bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laneserve.policies.prefill.base import PrefillScheduler
from laneserve.policies.prefill.mechanisms.sedf_tasks import (GRANULARITIES, Granularity,  # noqa: F401
                                                              PreemptiveTasks, PrefillTask,
                                                              SEDFMechanismOptions, SEDFWiring,
                                                              check_sedf_options)
from laneserve.policies.registry import register


@dataclass(frozen=True, slots=True)
class SEDFOptions(SEDFMechanismOptions):
    """FlowPrefill's options: its components'
    (:class:`~.mechanisms.sedf_tasks.SEDFMechanismOptions`)."""


@register("prefill", "sedf", aliases={
    "flowprefill": {}, "s-edf": {},
    "dedf": {"ordering": "dedf"}, "d-edf": {"ordering": "dedf"},
    "edf": {"ordering": "edf"}, "naive-edf": {"ordering": "edf"},
    "sedf-nobatch": {"batching": False},
    "sedf-g2k": {"token_budget": 2048}, "sedf-g4k": {"token_budget": 4096}, "sedf-g8k": {"token_budget": 8192},
    "sedf-layer": {"preemption": "layer"}, "sedf-chunk": {"preemption": "chunk"},
    "sedf-nopreempt": {"preemption": "none"},
})
class SEDFPrefill(SEDFWiring, PrefillScheduler):
    name = "sedf"
    Options = SEDFOptions
    options: SEDFOptions

    def __init__(self, kv, options: SEDFOptions | None = None, *, predictor: Any = None,
                 cost_model: Any = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        self.name = (f"{o.ordering}" + ("" if o.batching else "-nobatch") + f"-g{o.token_budget}"
                     + ("" if o.preemption == "operator" else f"-{o.preemption}"))
        self.compose_sedf(o, predictor=predictor, cost_model=cost_model)
