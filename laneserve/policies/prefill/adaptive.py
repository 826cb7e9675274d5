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
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.request import Request
from laneserve.core.sorted_window import SortedWindow
from laneserve.policies.options import at_least, option_error
from laneserve.policies.prefill.flowprefill import FlowPrefillOptions, FlowPrefillScheduler
from laneserve.policies.registry import register


@dataclass(frozen=True, slots=True)
class AdaptivePrefillOptions(FlowPrefillOptions):
    boundary: int = 256          # L_m, the short/long lane boundary (new tokens)
    window: int = 256            # recent arrivals whose lengths are watched
    min_share: float = 0.05      # bimodal: each lane holds at least this share of them...
    long_factor: float = 4.0     # ...and the long lane's median is at least this x boundary
    lanes: bool = True           # False: never split lanes (plain S-EDF)

    def validate(self) -> None:
        FlowPrefillOptions.validate(self)
        at_least(self, "boundary", 1)
        at_least(self, "window", 1)
        if not 0 < self.min_share < 0.5:
            raise option_error("min_share", "must be in (0, 0.5)", self.min_share)
        at_least(self, "long_factor", 1)


@register("prefill", "adaptive")
class AdaptivePrefill(FlowPrefillScheduler):
    name = "adaptive"
    Options = AdaptivePrefillOptions
    options: AdaptivePrefillOptions

    def __init__(self, kv, options: AdaptivePrefillOptions | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        self.boundary, self.min_share, self.long_factor = o.boundary, o.min_share, o.long_factor
        self.lanes_on = o.lanes
        self.name = "adaptive"
        self._lengths = SortedWindow(o.window)     # the new-token lengths of the last arrivals
        self._bimodal = False

    @property
    def bimodal(self) -> bool:
        """Whether the recent prompt lengths are bimodal (lanes in force)."""
        return self._bimodal

    def _push(self, req: Request, now: float) -> None:
        self._lengths.add(req.prompt_len - self.cached_prefix(req))
        self._bimodal = self.lanes_on and self._lengths_bimodal()
        super()._push(req, now)

    def _lengths_bimodal(self) -> bool:
        """Kept as arrivals come (a window of up to ``window`` lengths, sorted), so a decision
        costs O(1), not a pass and a sort over the window."""
        lengths = self._lengths
        size = len(lengths)
        if size < 16:
            return False
        short = lengths.count_below(self.boundary)
        share = 1 - (size - short) / size
        if not self.min_share <= share <= 1 - self.min_share:
            return False
        return lengths.median(short) >= self.long_factor * self.boundary    # the long lengths' median

    def _candidates(self, walk, head_key, bound):
        """Algorithm 1's candidates, only from the head's lane while lanes are in force: the other
        lane's requests would all be refused by :meth:`_may_join`, and refusing them changes
        nothing Algorithm 1 decides (its batch and its stopping test move only when a request
        joins), so they are not walked one by one (a long head behind thousands of short prompts)."""
        if not self._bimodal:
            return super()._candidates(walk, head_key, bound)
        head = self.requests[head_key[3]]
        boundary = self.boundary
        if head.remaining_prefill < boundary:
            return self._queue.ordered_below(head_key, lambda: min(bound(), boundary))
        return self._queue.ordered_below(head_key, bound, floor=boundary)

    def _may_join(self, head: Request, req: Request) -> bool:
        if not self._bimodal:
            return True
        return (head.remaining_prefill < self.boundary) == (req.remaining_prefill < self.boundary)
