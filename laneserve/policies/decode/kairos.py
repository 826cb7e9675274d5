"""Kairos slack-guided adaptive decode batching (Kairos §3.2, Algorithm 3, Eq. 2).

Before each step, every running request ``r`` gets a slack against its TPOT target::

    slack_r = T_SLO * (n_gen + 1) - (now - t_first_token) - reserve_r

``n_gen`` counts the tokens decoded after the first one (``num_output_tokens - 1``), so the token
this step would produce is due at ``t_first_token + T_SLO * num_output_tokens``: meeting every such
deadline is exactly a mean TPOT ``(last - first) / (n - 1) <= T_SLO``. ``reserve_r`` is the step
time ``r`` still needs: ``LUT[1, len_r]`` in Algorithm 3 (``slack_reserve="single"``, the
default) or ``LUT[|D|, len_r]`` in Eq. 2, which names the batch size (``"batch"``; an ablation).
With ``s_min = min_r slack_r``, requests are scanned by ascending length; ``r`` joins the batch
``B`` when ``LUT[|B|+1, len_r] <= s_min`` and throughput improves,
``(|B|+1) / t_step > |B| / t_cur`` (always true for the first). The others are delayed for one
step; they keep their KV and stay running. When nothing joined, everyone decodes.

The step-time table is :class:`~laneserve.costmodel.StepTimeLUT`, keyed by
``(batch size, length)``. ``length_key`` says which length stands for a batch: ``"max"``, the
longest KV context (``max(context_len)``, counting the token the step processes) — the exact key
for padded attention, whose step pays ``batch * max(ctx)``, and Algorithm 3's line 24; or
``"mean"``, the mean context — exact for ragged kernels, which pay ``sum(ctx)`` (a uniform batch
of the mean length has the same sum). The default follows the attention kind of the cost model the
table comes from (padded → max, ragged → mean). With ``"max"`` and candidates scanned by ascending
length, ``len_r`` is the batch's longest context in the test of line 12. The table starts from (in
order of precedence) ``lut``, a ``profile`` file, ``cost_model`` (uniform batches at the grid
points) or the analytic roofline of ``model``/``hardware``/``tp``/``attention`` (default
Llama-3-8B, H100, padded), on a grid with two points per octave; the simulator replaces it with
the run's predictor (:meth:`KairosDecode.bind_cost_model`: the run's own cost model, a profile fit,
or a learned model whose refits fill the cells not observed yet). After every pure decode step (no
recompute prefills, no swaps) the observed duration is folded into its cell's running mean (§3.2,
"updates the LUT at runtime").

Late requests (``late_binds``). A request whose slack is already negative (its next token will be
late whatever this step does; e.g. it waited seconds for decode memory after its first token)
makes ``s_min < 0`` in Algorithm 3, so nothing fits and everyone decodes — for as long as it stays
late, which under padded attention (mixed steps far above the SLO) is its whole life: one hopeless
request turns Kairos into continuous batching. With ``late_binds=False`` ``s_min`` is the minimum
over on-time requests (when there are any); late requests are still scanned like the others and
decode in steps they fit, in everyone-decodes steps, and at the starvation bound. With a ragged
kernel, where an everyone-decodes step costs little more than a partial one and lets late requests
catch up, the paper's rule is better. Default: ``False`` with ``length_key="max"`` (padded),
``True`` with ``"mean"`` (ragged); ``benchmarks/decode_kairos.py`` measures both.

Beyond the paper, and documented as such:

* requests without a TPOT target use ``tpot_slo`` (None: they have infinite slack and never bind
  ``s_min``); since their slack never runs out, a request delayed ``max_delay_steps`` steps in a
  row forces an everyone-decodes step (starvation bound). With finite targets the slack rule
  already bounds delays: a delayed request's slack shrinks every step until nothing fits.
* ``pace=True`` turns on the token pacing buffer (:mod:`.mechanisms.pacing`), releasing tokens produced ahead
  of schedule at the SLO pace; off by default.
* do no harm (``guard=True``, the registered ``kairos``; ``kairos-literal`` has it off): everyone
  decodes when the everyone-decodes step fits the smallest slack (:meth:`everyone_fits`), and on
  a ragged kernel selection is off for good (:func:`selection_pays`): the policy is continuous
  batching there.

Memory admission, growth and preemption are :class:`DecodeScheduler`'s (the same as continuous
batching); Kairos only chooses which running requests decode in a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Request
from laneserve.costmodel import StepTimeLUT, make_cost_model
from laneserve.costmodel.base import CostModel
from laneserve.policies.base import StepOutcome
from laneserve.policies.decode.base import DecodeOptions, DecodeScheduler
from laneserve.policies.decode.mechanisms.pacing import TokenPacer
from laneserve.policies.options import above, at_least
from laneserve.policies.registry import register

SlackReserve = Literal["single", "batch"]
LengthKey = Literal["max", "mean"]


def geometric_edges(lo: int, hi: int, per_octave: int = 2) -> tuple[int, ...]:
    """Integer grid points from ``lo`` to ``hi`` with ``per_octave`` points per doubling."""
    points = {lo, hi}
    k = 0
    while (value := round(lo * 2 ** (k / per_octave))) < hi:
        points.add(value)
        k += 1
    return tuple(sorted(points))


def default_lut(cost: CostModel, max_batch_size: int, max_length: int = 1 << 18,
                prior_count: int = 1) -> StepTimeLUT:
    return StepTimeLUT.from_cost_model(
        cost, prior_count=prior_count,
        batch_edges=geometric_edges(1, max(2, max_batch_size)),
        length_edges=geometric_edges(16, max_length))


def selection_pays(kernel: str | None) -> bool:
    """Whether slack-guided selection can pay on a decode attention kernel (do no harm: the
    ``guard`` of :class:`KairosDecode`, and adaptive decode). Not on a ragged kernel: there a step
    costs its total context, so leaving a long request out speeds the others up by about the time
    it loses itself. On the policy league (Llama-3-8B, ragged kernel) selection never beat
    continuous batching and lost on the long-context workloads (Kairos setup at 4P+4D: 0.89x of
    its goodput), and ``benchmarks/decode_kairos.py``'s ragged rows gain nothing (-0.3 points of
    TPOT attainment). With a padded kernel (a step pays batch x longest context: the straggler
    effect Algorithm 3 is for) or an unknown one, it runs."""
    return kernel != "ragged"


@dataclass(slots=True)
class Held:
    """A request's record under Kairos decode (``req.policy_state.of(Held)``): the consecutive
    steps it was held back (the ``max_delay_steps`` bound)."""

    steps: int = 0


@dataclass(slots=True)
class KairosStats:
    steps: int = 0             # decode steps built
    partial_steps: int = 0     # steps that delayed at least one running request
    fallback_steps: int = 0    # nothing fitted the slack: everyone decoded
    forced_steps: int = 0      # starvation bound hit: everyone decoded
    guard_steps: int = 0       # the everyone-decodes step fitted the smallest slack: everyone decoded
    delayed: int = 0           # request-steps delayed
    lut_updates: int = 0


@dataclass(frozen=True, slots=True)
class KairosDecodeOptions(DecodeOptions):
    profile: str | None = None          # engine profile JSON for the step table
    model: str = "llama-3-8b"           # the analytic step table's model, hardware, tp, kernel
    hardware: str = "h100"
    tp: int = 1
    attention: str = "padded"
    length_key: LengthKey | None = None     # None: follow the attention kernel
    tpot_slo: float | None = None
    slack_reserve: SlackReserve = "single"
    throughput_rule: bool = True
    online_update: bool = True
    late_binds: bool | None = None      # None: follow length_key
    max_delay_steps: int = 64
    pace: bool = False
    pace_tpot: float | None = None
    guard: bool = True                  # do no harm: everyone decodes when everyone fits the smallest slack

    def validate(self) -> None:
        DecodeOptions.validate(self)
        above(self, "tpot_slo", 0)
        at_least(self, "max_delay_steps", 1)


@register("decode", "kairos", aliases={"kairos-eq2": {"slack_reserve": "batch"},
                                       "kairos-literal": {"late_binds": True, "guard": False},
                                       "kairos-paced": {"pace": True}})
class KairosDecode(DecodeScheduler):
    name = "kairos"

    Options = KairosDecodeOptions
    options: KairosDecodeOptions

    def __init__(self, kv: KVCacheManager, options: KairosDecodeOptions | None = None, *,
                 host_pool: HostKVPool | None = None, lut: StepTimeLUT | None = None,
                 cost_model: CostModel | None = None, **opts) -> None:
        super().__init__(kv, options, host_pool=host_pool, **opts)
        o = self.options
        profile, attention, length_key, late_binds, tpot_slo = (o.profile, o.attention, o.length_key,
                                                                o.late_binds, o.tpot_slo)
        cost = cost_model
        self._table_given = lut is not None or profile is not None or cost_model is not None
        self._length_key_given = length_key is not None
        self._late_binds_given = late_binds is not None
        self._learned = None                     # a LearnedCostModel the table follows (online)
        self._learned_version = -1
        if lut is None:
            if profile is not None:
                from laneserve.costmodel import load_profile
                lut = StepTimeLUT.from_profile(load_profile(profile))
            else:
                cost = cost or make_cost_model("analytic", model=o.model, hardware=o.hardware,
                                                     tp=o.tp, attention=attention)
                lut = default_lut(cost, o.max_batch_size)
        self.lut = lut
        if length_key is None:      # follow the attention kernel the step times come from
            kind = getattr(cost, "attention", None) if cost is not None else attention
            length_key = "mean" if kind == "ragged" else "max"
        self.length_key = length_key
        # padded: a late straggler in every step slows everyone, so late requests do not bind;
        # ragged: a decode-all step costs little more than a partial one, so they do (Algorithm 3)
        self.late_binds = (length_key == "mean") if late_binds is None else late_binds
        self.tpot_slo = tpot_slo
        self.slack_reserve = o.slack_reserve
        self.throughput_rule = o.throughput_rule
        self.online_update = o.online_update
        self.max_delay_steps = o.max_delay_steps
        self.guard = o.guard
        self.pacer = TokenPacer(enabled=o.pace, tpot=tpot_slo, force_tpot=o.pace_tpot)
        self.stats = KairosStats()
        self._follow_kernel(getattr(cost, "attention", None))

    def bind_cost_model(self, cost_model: CostModel) -> None:
        """The step table from the run's cost model (oracle or profile: filled once) or a
        :class:`~laneserve.policies.predictors.LearnedCostModel` (online: cells no step has been
        observed in follow the model at each of its refits), unless the constructor was given a
        ``lut``, ``profile`` or ``cost_model``. ``length_key`` and ``late_binds``, unless given, follow the model's attention kind.
        Guarded, selection stays on only where it can pay (:func:`selection_pays`)."""
        self._follow_kernel(getattr(cost_model, "attention", None))
        if self._table_given:
            return
        learned = hasattr(cost_model, "decode_version")
        self._learned = cost_model if learned else None
        self.lut = default_lut(cost_model, self.max_batch_size, prior_count=0 if learned else 1)
        self._learned_version = getattr(cost_model, "decode_version", -1)
        if not self._length_key_given:
            self.length_key = "mean" if getattr(cost_model, "attention", None) == "ragged" else "max"
        if not self._late_binds_given:
            self.late_binds = self.length_key == "mean"

    def _follow_kernel(self, kernel: str | None) -> None:
        """``selects``: Algorithm 3 runs unless the guard is on and the kernel is one where
        selection cannot pay. Not selecting, the step table is neither refreshed nor updated
        (nothing reads it)."""
        self.selects = not self.guard or selection_pays(kernel)

    @property
    def stable_decode_batch(self) -> bool:      # type: ignore[override]
        """Not selecting (and not pacing), every step decodes every running request, as
        continuous batching does, so a simulator may run stable batches as one event."""
        return not self.selects and not self.pacer.enabled

    def _follow_learned(self) -> None:
        """Refresh the never-observed cells from the learned model after it refitted."""
        model = self._learned
        if model is None or model.decode_version == self._learned_version:
            return
        self._learned_version = model.decode_version
        self.lut.fill_unobserved(default_lut(model, self.max_batch_size, prior_count=0))

    # ---- Algorithm 3 -----------------------------------------------------------------------
    def target(self, req: Request) -> float | None:
        return req.slo.tpot if req.slo.tpot is not None else self.tpot_slo

    def slack(self, req: Request, now: float, batch_size: int = 1) -> float:
        """Eq. 2 / Algorithm 3 line 5: time left before ``req``'s next token is due, less the
        step time it needs (``LUT[batch_size, len_r]``); infinite without a TPOT target."""
        tpot = self.target(req)
        if tpot is None:
            return math.inf
        return self._due(req, now, tpot) - now - self.lut.lookup(batch_size, req.context_len)

    @staticmethod
    def _due(req: Request, now: float, tpot: float) -> float:
        """When ``req``'s next token is due: T_SLO * (n_gen + 1) after its first token."""
        first = req.times.first_token if req.times.first_token is not None else now
        return first + tpot * req.num_output_tokens

    def batch_length(self, batch: list[Request]) -> int:
        """The LUT length key of a batch: its longest context (padded) or mean context (ragged)."""
        if self.length_key == "mean":
            return max(1, round(sum(r.context_len for r in batch) / len(batch)))
        return max(r.context_len for r in batch)

    def select(self, active: list[Request], now: float) -> list[Request]:
        """The requests to decode this step (Algorithm 3, lines 3-21)."""
        if not active:
            return []
        if self.guard and self.everyone_fits(active, now):
            self.stats.steps += 1
            self.stats.guard_steps += 1
            for req in active:
                req.policy_state.of(Held).steps = 0
            return list(active)
        s_min = self._min_slack(active, now)
        lookup = self.lut.lookup
        by_mean = self.length_key == "mean"
        batch: list[Request] = []
        t_cur = 0.0
        kv_sum = 0
        # a step time is never negative: with s_min < 0 nothing fits, so the scan is skipped
        for req in sorted(active, key=lambda r: (r.context_len, r.request_id)) if s_min >= 0 else ():
            n = len(batch) + 1
            t_step = lookup(n, (kv_sum + req.context_len) / n if by_mean else req.context_len)
            if t_step <= s_min and (not batch or not self.throughput_rule
                                    or (len(batch) + 1) / t_step > len(batch) / t_cur):
                batch.append(req)
                t_cur = t_step
                kv_sum += req.context_len
        stats = self.stats
        stats.steps += 1
        if not batch:
            stats.fallback_steps += 1
            batch = list(active)
        chosen = {r.request_id for r in batch}
        if len(batch) < len(active) and any(
                r.policy_state.of(Held).steps + 1 >= self.max_delay_steps
                for r in active if r.request_id not in chosen):
            stats.forced_steps += 1
            batch = list(active)
            chosen = {r.request_id for r in batch}
        for req in active:
            if req.request_id in chosen:
                req.policy_state.of(Held).steps = 0
            else:
                req.policy_state.of(Held).steps += 1
                stats.delayed += 1
        if len(batch) < len(active):
            stats.partial_steps += 1
        return batch

    def everyone_fits(self, active: list[Request], now: float) -> bool:
        """The everyone-decodes step fits the smallest slack (the guard, and adaptive decode's
        shortcut). A lower bound of the smallest slack charges every request the single-request
        step of the longest, so this never says yes where Algorithm 3's own test says no."""
        default, due, longest = self.tpot_slo, math.inf, 0
        for r in active:       # the earliest next-token due time (_due, target) and the longest context
            tpot = r.slo.tpot if r.slo.tpot is not None else default
            if tpot is not None:
                first = r.times.first_token
                d = (first if first is not None else now) + tpot * r.num_output_tokens
                if d < due:
                    due = d
            if r.prompt_len + r.num_output_tokens > longest:
                longest = r.prompt_len + r.num_output_tokens
        if due == math.inf:    # no target (or none that can be missed)
            return True
        s_min = due - now - self.lut.lookup(1, longest)
        return self.lut.lookup(len(active), self.batch_length(active)) <= s_min

    def _min_slack(self, active: list[Request], now: float) -> float:
        """``s_min`` of Algorithm 3 (without ``late_binds``: over the on-time requests when some
        are late), exact when it is >= 0; when it is negative, some negative slack (nothing can
        fit then, its value does not matter). A request whose next token is already due
        (``due < now``) has a negative slack whatever its table entry (step times are never
        negative), so only the others are looked up: a step of mostly late requests costs no
        table lookups."""
        reserve_batch = len(active) if self.slack_reserve == "batch" else 1
        lookup, default = self.lut.lookup, self.tpot_slo
        late = math.inf                       # the smallest slack below 0 seen
        on_time = math.inf                    # the smallest slack >= 0 (infinite: no target)
        any_on_time = False
        for req in active:
            tpot = req.slo.tpot if req.slo.tpot is not None else default
            if tpot is None:
                any_on_time = True            # infinite slack
                continue
            first = req.times.first_token
            left = (first if first is not None else now) + tpot * req.num_output_tokens - now
            if left < 0:
                if self.late_binds:
                    return left               # s_min < 0
                if left < late:
                    late = left
                continue
            slack = left - lookup(reserve_batch, req.context_len)
            if slack < 0:
                if self.late_binds:
                    return slack
                if slack < late:
                    late = slack
            else:
                any_on_time = True
                if slack < on_time:
                    on_time = slack
        return on_time if any_on_time or late == math.inf else late

    # ---- the scheduler contract ------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        if self.selects:
            self._follow_learned()
        plan = self._prepare_step(now)
        plan.decodes = self.select(self.running, now) if self.selects else list(self.running)
        return None if plan.is_empty else plan

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        if (self.selects and self.online_update and result.completed and plan.decodes and not plan.prefills
                and not plan.swap_in and not plan.swap_out):
            # keyed before the counters advance: the contexts this step attended over
            self.lut.observe(len(plan.decodes), self.batch_length(plan.decodes), result.duration)
            self.stats.lut_updates += 1
        return super().update(plan, result, now)

    def _advance_decode(self, req: Request, sampled: dict[int, int] | None,
                        stop_hit: set[int] | None, now: float, outcome: StepOutcome) -> None:
        # the pacing buffer stamps delivery times; counters and KV advance now
        super()._advance_decode(req, sampled, stop_hit, self.pacer.release_time(req, now), outcome)

    def _remove(self, req: Request) -> None:
        req.policy_state.of(Held).steps = 0
        super()._remove(req)
