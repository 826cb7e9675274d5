"""``adaptive`` prefill: S-EDF with operator preemption (FlowPrefill §5), plus LAPS' length lanes
when the observed prompt lengths are bimodal.

Why this composition: on every workload we measured (``benchmarks/adaptive_check``)
FlowPrefill's ordering generalises — priority ``sgn(slack)/deadline`` serves what can still make
its TTFT first, operator-level preemption lets an urgent arrival past a running long prefill, and
SLO-aware batching (Algorithm 1) grows a batch only while its head still meets its deadline. It
needs no tuning to the length mix and degrades to FCFS-like batching when every request has slack.
What it lacks is LAPS' observation that short and long prefills should not share a step: a long
member makes every short one in its batch wait for its compute. So the policy watches the new-token
lengths of the last ``window`` arrivals and, when they are bimodal — between ``min_share`` and
``1 − min_share`` of them under the lane boundary L_m (``boundary``, 256 as in LAPS) and the median
of the rest at least ``long_factor`` × L_m — Algorithm 1 batches only requests of the head's lane
(LAPS' mutual exclusion). Ordering and preemption stay S-EDF's, so a short request behind a long
one still preempts it at the next operator boundary.

Choices for the other mechanisms, from measurement (``benchmarks/adaptive_check.py``): Kairos'
urgency-per-token chunk ordering and LAPS' AWD windows and shape buckets add nothing over S-EDF in
the simulator (the captured CUDA-graph shapes that make buckets pay exist only on the engine), and
fixed-size chunking (CP-EDF, LAPS' long chunks) loses throughput on ~2K prompts, so they are not
composed in. Predictions are the TTFT polynomial of FlowPrefill (fitted to the bound cost model,
else learned online); the choices above use only observed lengths, and the ordering only compares
slacks, so a predictor ~20% off moves decisions at the margin, not the regime.

Composition (the class derives from :class:`~.base.PrefillScheduler` alone, so editing the ``sedf``
reproduction cannot change it): it holds the same components as ``sedf`` (:mod:`.flowprefill`) —
``self.ordering`` (:class:`~.mechanisms.sedf_ordering.SEDFOrdering`: S-EDF priorities, waiting set and TTFT
predictor), ``self.batcher`` (:class:`~.mechanisms.slo_batching.SLOAwareBatching`: Algorithm 1) and
``self.tasks`` (:class:`~.mechanisms.sedf_tasks.PreemptiveTasks`: operator preemption, Algorithm 2, the
suspension bound) — plus its own ``self.lanes`` (:class:`~.mechanisms.bimodal_lanes.BimodalLanes`), handed
to Algorithm 1. Its options declare the same S-EDF fields and defaults as ``sedf``'s, except one.

Late parked tasks (``bound_late=False``; ``sedf`` keeps FlowPrefill's ``True``). FlowPrefill
bounds every suspension: a task parked for ``max_suspension`` (10 s) is resumed ahead of any
priority and is not preempted again. Where prompts are long against their TTFT target and the
instance is overloaded, the tasks parked that long are mostly ones that can no longer make their
target, and each forced resume runs a long hopeless prefill ahead of requests that still can:
on ``long_context_mix`` (TTFT 8 s, 1P+1D, 1 req/s; ``benchmarks/longctx_hol.py``) adaptive met
TTFT for 0.835 of requests, prompts under 2K tokens included (0.96), against 0.92 for Kairos'
prefill, whose late requests simply go last. So adaptive's bound skips a task that is late at its
bound; the task waits in priority order like a late waiting request and runs when nothing that
can still make its target waits, or when KV memory is short (Algorithm 2 then resumes the best
parked task). Tasks that can still make their targets, and those without one, keep the bound,
and so do late tasks while more than ``late_parked_cap`` (16) are parked: each holds its KV
blocks and, on the engine, its activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laneserve.core.request import Request
from laneserve.policies.options import at_least, option_error
from laneserve.policies.prefill.base import PrefillScheduler
from laneserve.policies.prefill.mechanisms.bimodal_lanes import BimodalLanes
from laneserve.policies.prefill.mechanisms.sedf_tasks import SEDFMechanismOptions, SEDFWiring
from laneserve.policies.registry import register


@dataclass(frozen=True, slots=True)
class AdaptivePrefillOptions(SEDFMechanismOptions):
    """S-EDF's components' options (:class:`~.mechanisms.sedf_tasks.SEDFMechanismOptions`, with sedf's
    defaults), then the lanes'."""

    # not sedf's default: the suspension bound does not force a task already late at its bound
    # (see the module docstring, "Late parked tasks")
    bound_late: bool = False

    # the lanes (.bimodal_lanes)
    boundary: int = 256          # L_m, the short/long lane boundary (new tokens)
    window: int = 256            # recent arrivals whose lengths are watched
    min_share: float = 0.05      # bimodal: each lane holds at least this share of them...
    long_factor: float = 4.0     # ...and the long lane's median is at least this x boundary
    lanes: bool = True           # False: never split lanes (plain S-EDF)

    def validate(self) -> None:
        SEDFMechanismOptions.validate(self)
        at_least(self, "boundary", 1)
        at_least(self, "window", 1)
        if not 0 < self.min_share < 0.5:
            raise option_error("min_share", "must be in (0, 0.5)", self.min_share)
        at_least(self, "long_factor", 1)


@register("prefill", "adaptive")
class AdaptivePrefill(SEDFWiring, PrefillScheduler):
    name = "adaptive"
    Options = AdaptivePrefillOptions
    options: AdaptivePrefillOptions

    def __init__(self, kv, options: AdaptivePrefillOptions | None = None, *, predictor: Any = None,
                 cost_model: Any = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        self.lanes = BimodalLanes(o.boundary, o.window, o.min_share, o.long_factor, enabled=o.lanes)
        self.compose_sedf(o, predictor=predictor, cost_model=cost_model, lanes=self.lanes)

    @property
    def bimodal(self) -> bool:
        """Whether the recent prompt lengths are bimodal (lanes in force)."""
        return self.lanes.bimodal

    # ---- queues: the lanes watch every arrival's new tokens ------------------------------------
    def _push(self, req: Request, now: float) -> None:
        self.lanes.observe(req.prompt_len - self.cached_prefix(req))
        super()._push(req, now)
