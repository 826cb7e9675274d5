"""``adaptive`` decode: continuous batching that turns on Kairos' slack-guided steps and
AlignedServe's length-aligned batches only when they pay (docs/design.md, "adaptive").

Every step starts from what the instance observes: the requests it holds (their KV lengths and
TPOT targets), its KV memory, and step times (the bound cost model, refined online by measured
steps). Three mechanisms compose:

1. **Length-aligned batches** (AlignedServe §3, :class:`~.mechanisms.aligner.LengthAligner` guarded by
   :class:`~.mechanisms.aligned_guard.AlignmentGuard`, as ``alignedserve`` with ``guard=True``), on by
   default with a host KV pool (``adaptive:align=false`` turns them off): alignment runs only
   where it can pay, i.e. the attention kernel pads a mixed batch to its longest member, the
   padding is at least ``tpot_margin`` of the everyone-decodes step, and continuous batching is in
   trouble (the decode KV memory cannot hold every request, or that step would break the tightest
   TPOT target). With a ragged kernel (the league's cost model) it never aligns, so this default
   decides exactly as ``align=false`` there (tested); the earlier opt-in guard let alignment in on
   long-context Mooncake-length traffic, where it lost (docs/design.md, "adaptive: what the league
   measured"). Otherwise incoming KV
   lands on the device and every request decodes: continuous batching. Without a host KV pool
   (``--host-kv-tokens 0``) nothing can be parked and alignment stays off.
2. **Slack-guided steps** (Kairos §3.2, Algorithm 3) choose which running requests decode: the
   requests that fit in the smallest TPOT slack join in ascending length while throughput grows;
   when nothing fits (or there is slack to spare) everyone decodes, so with ample slack this *is*
   continuous batching. The step table starts from the bound cost model and folds every measured
   pure decode step into its cell (a running mean), so a predictor ~20% off converges to the
   measured times instead of steering by its error. Only with a padded kernel (or an unknown
   one): with a ragged kernel selection cannot pay (:func:`.kairos.selection_pays`) and every
   request decodes, so there this policy is continuous batching (a stable batch, which the
   simulator runs as one event).
3. Memory admission, growth and preemption are continuous batching's (swap to the host pool when
   there is one, else recompute).
4. **Placement** (``preferred_decode_router``): with ``decode_router="auto"`` (the simulator's and
   ``laneserve sim``'s default) finished prefills reach adaptive decode instances through the
   ``tpot-aware`` router (:mod:`laneserve.policies.routing_tpot`), which keeps long contexts from
   joining the steps of short requests whose TPOT they would break. On the league's Kairos
   workload (Mooncake lengths, 4P+4D) that, not prefill order, bounds goodput.
5. **Intake under memory pressure** (:mod:`.mechanisms.intake`): when the decode memory is the bottleneck,
   finished prefills wait as offered transfers, and the wait counts against their TPOT. Oldest
   first (every other policy's order) while the oldest offer could still meet the target of the
   shortest tenth of recent outputs; past that, newest first until the backlog clears, and any
   offer waiting ``max_offer_wait`` seconds goes first. On the league's ShareGPT workload, where
   decode KV memory bounds every policy, that is +9% goodput at 1P+1D and 4P+4D.
6. **Slack-sized batches** (:meth:`_batch_limit`): ``max_batch_size`` (256, vLLM's default
   ``max_num_seqs``) is where admission stops only while the predicted step of a larger batch
   would break the tightest TPOT target (times ``1 + tpot_margin``); below that, waiting requests
   join up to ``batch_ceiling`` (1024). On short-context traffic the fixed cap, not the GPU, made
   requests wait between their first and second tokens (the league's AlignedServe 95%-short mix:
   every TPOT miss there had waited for a batch slot, none for memory or a slow step).
7. **TPOT-infeasible contexts on the others' slack** (:mod:`.mechanisms.infeasible_gate`,
   ``defer_infeasible``): a request whose step alone is over its TPOT target cannot meet it, and without split-KV it sets
   the step of every request beside it. It decodes only while the feasible requests it runs with
   can afford the longer step (each keeps ``infeasible_reserve`` TPOTs of slack), at least once
   every ``infeasible_bound`` seconds, and always while a hand-off waits for decode memory. On
   ``long_context_mix`` (``benchmarks/longctx_why.py``) that, not the prefill order, is what
   Kairos' prefill got right by deferring long prompts.

Composition: the class derives from :class:`~.base.DecodeScheduler` alone (memory admission,
growth, swap/recompute preemption), so editing a reproduction cannot change it. It holds

- ``self.aligner``: a :class:`~.mechanisms.aligner.LengthAligner` (the component ``alignedserve`` holds)
  with an :class:`~.mechanisms.aligned_guard.AlignmentGuard` that is always on (1.; the guard's step
  predictions also size the batches of 6.);
- ``self.selector``: a :class:`~.kairos.KairosDecode` used only for its ``select`` rule and its
  table (2.); it holds no requests;
- ``self.intake``: an :class:`~.mechanisms.intake.OfferIntake` (5.).

Its options declare AlignedServe's fields with AlignedServe's defaults (``guard`` stays, always
True), plus its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import StepPlan, StepResult
from laneserve.policies.base import StepOutcome
from laneserve.policies.decode.mechanisms.aligned_guard import AlignmentGuard
from laneserve.policies.decode.mechanisms.aligner import AlignedWiring, AlignmentOptions, LengthAligner
from laneserve.policies.decode.base import DecodeScheduler
from laneserve.policies.decode.mechanisms.infeasible_gate import InfeasibleGate
from laneserve.policies.decode.mechanisms.intake import OfferIntake
from laneserve.policies.decode.kairos import KairosDecode, selection_pays
from laneserve.policies.options import above, at_least, option_error
from laneserve.policies.registry import register
from laneserve.policies.routing import DecodeSummary


@dataclass(frozen=True, slots=True)
class AdaptiveDecodeOptions(AlignmentOptions):
    """The aligner's and its guard's options (:class:`~.mechanisms.aligner.AlignmentOptions`: AlignedServe's
    defaults; ``guard`` is always on here), then adaptive's own."""

    # adaptive's own
    slack_guided: bool = True      # Kairos' slack-guided selection when not everyone fits
    align: bool = True             # align batches when a host pool is given and alignment pays
    intake: Literal["slack", "newest", "oldest"] = "slack"   # which offered KV transfer goes first (.intake)
    max_offer_wait: float = 30.0   # seconds since its first token after which an offer goes first
    batch_ceiling: int = 1024      # past max_batch_size, a step may hold up to this many while TPOT allows
    defer_infeasible: bool = True  # TPOT-infeasible requests decode on the others' slack (.infeasible_gate)
    infeasible_reserve: float = 1.0   # TPOTs of slack each feasible request keeps from them
    infeasible_bound: float = 5.0     # seconds an infeasible request waits at most between tokens

    def validate(self) -> None:
        AlignmentOptions.validate(self)
        if not self.guard:
            raise option_error("guard", "is always on in adaptive decode", self.guard)
        above(self, "max_offer_wait", 0)
        at_least(self, "batch_ceiling", 0)
        at_least(self, "infeasible_reserve", 0)
        above(self, "infeasible_bound", 0)


@register("decode", "adaptive")
class AdaptiveDecode(AlignedWiring, DecodeScheduler):
    name = "adaptive"
    needs_host_pool = False          # aligns only with a host pool the user gives (--host-kv-tokens)
    #: the decode router of ``decode_router="auto"``: placement that keeps long contexts from
    #: slowing short requests' steps (laneserve.policies.routing_tpot)
    preferred_decode_router = "tpot-aware"

    Options = AdaptiveDecodeOptions
    options: AdaptiveDecodeOptions

    def __init__(self, kv: KVCacheManager, options: AdaptiveDecodeOptions | None = None, *,
                 host_pool: HostKVPool | None = None, **opts) -> None:
        pool = host_pool if host_pool is not None else HostKVPool(0, kv.block_size)
        super().__init__(kv, options, host_pool=pool, **opts)
        o = self.options
        self.can_align = o.align and host_pool is not None and host_pool.num_blocks > 0
        guard = AlignmentGuard(kv.block_size, can_align=self.can_align, tpot_margin=o.tpot_margin,
                               cb_memory_fraction=o.cb_memory_fraction,
                               align_memory_fraction=o.align_memory_fraction)
        self.aligner = LengthAligner(self, o, pool, guard)  # unable to align: the guard keeps no figures
        self.selector = KairosDecode(KVCacheManager(0, kv.block_size), max_batch_size=o.max_batch_size,
                                     attention="ragged", guard=False) if o.slack_guided else None
        self._kernel_selects = True                  # until a cost model says which kernel
        self.intake = OfferIntake(o.intake, o.max_offer_wait)
        self.gate = InfeasibleGate(o.infeasible_reserve, o.infeasible_bound) if o.defer_infeasible else None
        self._gated = False                          # the last continuous step was gated (7.)
        self._offer_refused = False                  # the last offered transfer tried did not fit

    # ---- slack-sized batches (6.) ----------------------------------------------------------
    def _batch_limit(self) -> int:
        """Slack-sized batches: past ``max_batch_size`` (vLLM's fixed cap), waiting requests join
        in order while the predicted step of the grown batch, times ``1 + tpot_margin``, stays
        within the tightest TPOT target of the batch, up to ``batch_ceiling``. A short-context
        batch capped at 256 decodes in well under a 50 ms target (Llama-3.1-8B/H100 analytic: 256
        x 1K tokens in 24 ms), so the cap, not the GPU, held requests back."""
        cap, running, waiting = self.max_batch_size, self.running, self.waiting
        if len(running) + len(waiting) <= cap or self.options.batch_ceiling <= cap:
            return cap
        batch = DecodeSummary.of(running)
        n, total, longest = batch.count, batch.total, batch.longest
        tight = min((t for t, _ in batch.tpots), default=math.inf)
        guard = self.aligner.guard
        margin, ceiling = 1 + guard.tpot_margin, self.options.batch_ceiling
        for r in waiting:
            if n >= ceiling:
                break
            c = r.context_len
            t = min(tight, r.slo.tpot) if r.slo.tpot is not None else tight
            step = guard.step_time(n + 1, total + c, max(longest, c))
            if step is None or step * margin > t:
                break
            n, total, longest, tight = n + 1, total + c, max(longest, c), t
        return max(cap, n)

    def can_reserve(self, req) -> bool:
        ok = super().can_reserve(req)
        self._offer_refused = not ok
        return ok

    def offer_end(self, pending, now: float) -> int:
        return self.intake.end(pending, now)

    def bind_cost_model(self, cost_model) -> None:
        self.aligner.bind_cost_model(cost_model)
        if self.selector is not None:
            self.selector.bind_cost_model(cost_model)
        self._kernel_selects = selection_pays(getattr(cost_model, "attention", None))

    # ---- slack-guided steps (2.) -----------------------------------------------------------
    @property
    def selecting(self) -> bool:
        """Slack-guided selection is on: asked for, and the kernel is not ragged."""
        return self.selector is not None and self._kernel_selects

    @property
    def stable_decode_batch(self) -> bool:      # type: ignore[override]
        """Neither aligning ever nor selecting: continuous batching, a stable batch."""
        return self.aligner.never_aligns and not self.selecting and not self._gated

    def _continuous_step(self, now: float) -> StepPlan | None:
        plan = self.aligner.continuous_step(now)
        self._gated = False
        if plan is not None and self.gate is not None and len(plan.decodes) > 1:
            everyone = plan.decodes
            plan.decodes = self.gate.select(everyone, now, self.aligner.guard.step_time,
                                            memory_bound=self._offer_refused)
            self._gated = self.gate.mixed
        if plan is not None and self.selecting and plan.decodes \
                and not self.selector.everyone_fits(plan.decodes, now):
            plan.decodes = self.selector.select(plan.decodes, now)
        return plan

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        sel = self.selector
        if (self.selecting and not self.aligner.aligning and result.completed and plan.decodes
                and not (plan.prefills or plan.swap_in or plan.swap_out)):
            sel.lut.observe(len(plan.decodes), sel.batch_length(plan.decodes), result.duration)
            sel.stats.lut_updates += 1
        outcome = super().update(plan, result, now)        # the aligner observes the step (AlignedWiring)
        for req in outcome.finished:
            self.intake.finished(req)
        return outcome

