"""LAPS prefill scheduler (the LAPS paper, §3): length lanes, AWD short batching into captured shape
buckets, long prefills in chunks — on one instance ("temporal" mode) or as one instance of a
spatially split pool ("spatial" mode, lanes assigned by the ``laps-pools`` router).

Every prefill is classified by its NEW tokens (prompt − cached prefix) against L_m
(:mod:`.mechanisms.laps_lanes`). The short and the long lane never share a step (mutual
exclusion) — except in the do-no-harm merge below.

Temporal alternation (our rule; the paper only says the instance alternates lanes): when the
instance is free,

1. the short lane runs if AWD says its batch is due (depth D reached, window expired, slack ≤ σ,
   head wait > T_max; token-max in deadline-free mode) — unless ``max_short_streak`` short
   batches in a row already ran while long work waited, then one long chunk goes first;
2. SLA-first guard (``sla_guard``, SLA-constrained mode): a short batch that is not yet due still
   goes now if running the next long chunk first would leave its tightest request no more than σ
   of slack — ``min DDL − (now + Ŝ_long + Ŝ) ≤ σ``, with Ŝ_long the chunk's predicted time (the
   bound cost model, else the last long step's observed time) and Ŝ AWD's short-batch estimate.
   AWD's own slack test only counts Ŝ; on one instance the alternative to dispatching is a long
   chunk that cannot be interrupted, so its time belongs in the slack too;
3. otherwise a long chunk runs (work-conserving: a short batch still filling its window waits
   for at most one chunk of ``long_chunk`` tokens);
4. otherwise the instance idles and asks for a wake-up at the window's expiry (``next_wakeup``).

Composition with FlowPrefill's preemption (``preempt="operator"|"layer"``; off by default, LAPS
itself never preempts): long chunks run as preemptible plans, and a running one is stopped at the
next operator (or layer) boundary when a short batch becomes due or the guard of rule 2 holds for
the chunk's remaining time; the parked chunk resumes (same plan object, identical results) the next
time the long lane runs. ``max_short_streak`` still lets one long chunk through after that many
short batches. With ``order=sedf`` this is LAPS' lanes with FlowPrefill's ordering and preemption.

A short batch takes the head of the short lane and the other requests of its length bucket (lane
order, up to the captured depth that fits ``short_budget`` padded tokens); the batch is padded to
the nearest captured ``(L, B)`` shape (``plan.padded_shape``) and the padding rows up to B are
filled with waiting requests of smaller buckets, which costs nothing more. A head longer than every
bucket (a fitted L_m above 256) runs unpadded. A long step fills ``long_chunk`` tokens with long
prefills in lane order, the last one taking a partial chunk (``long_batch="single"`` advances one
request per step, as the paper describes; "fill" is the default so that long prefills just above
L_m do not run in under-filled steps).

Do no harm. The registered ``laps`` departs from the paper where the league measured
harm (``benchmarks/league.py``; the figures: docs/design.md, "LAPS: what the league measured");
``laps-literal`` (``LITERAL``) is the paper's algorithm and the ablation presets
are ablations of it. Each guard is a constructor option:

* ``order="edf"``: lanes in TTFT-deadline order. With one SLO class this is arrival order, as in
  the paper; with several (FlowPrefill's task classes) arrival order let loose-SLO requests block
  tight ones.
* ``awd=False``: no batching window. Waiting only delays the queued short requests and idles the
  instance: graph replay saves ~2.5 ms a step on the analytic H100 model, a window costs up to
  ``w_max`` (30 ms) of every request in it, and requests that arrive during a step leave together
  in the next one anyway. (``light_load`` is the milder guard for ``awd=True``: no wait when the
  window cannot bring another request.)
* ``paid_padding=True``: a short batch is padded to its captured shape only when the bound cost
  model predicts the graph-replayed padded step no slower than the unpadded one (a lone 20-token
  prompt: yes; eight 150-token prompts padded to 8 x 256: no). A learned model knows nothing of
  replay and never pads; without a bound model the paper's padding stays.
* ``merge=True``: when both lanes hold work, one step carries the short lane (whole requests, up
  to ``short_budget`` tokens) and long chunks filling the long budget, if its predicted end leaves
  every short request in it more than σ of slack (:meth:`LapsPrefill._mixed_plan`). Mutual
  exclusion protects short prompts from a long step, but in the cost model a mixed step costs its
  tokens plus one fixed step cost, so a separate short step only adds a fixed cost; where a short
  request's slack would not survive the mixed step, the alternation below still runs it alone.
* ``step_slo_fraction=0.45``: long steps grow from ``long_chunk`` (2048) by doubling up to the
  instance's token budget (8192) while the predicted step takes at most that fraction of the
  tightest TTFT target seen, and only while no short request waits (:meth:`_long_budget`): each
  step pays a fixed cost, and fixed 2048-token chunks lost to whole-prompt FCFS on chat traffic
  whose targets allow larger steps.

The alternation and AWD below are the paper's mechanisms; with the defaults they run when the
merge does not apply (one lane empty, or a short request too tight for a mixed step).

Spatial mode: the router tags each request with its lane
(:class:`~.mechanisms.laps_lanes.LaneTag`) and tells the instance its pool with :meth:`LapsPrefill.set_lane`. An instance that changes pool keeps its queued
work and drains it by the same alternation (lanes still never mix in a step); new arrivals are only
of its new lane. Without a tag the instance classifies the request itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.shapes import ShapeGrid
from laneserve.costmodel.base import graphed_prefill_time
from laneserve.policies.options import at_least, within
from laneserve.policies.prefill.base import PrefillOptions, PrefillScheduler
from laneserve.policies.prefill.mechanisms.laps_awd import AdaptiveWaitDepth, AWDConfig
from laneserve.policies.prefill.mechanisms.laps_lanes import (LONG, SHORT, Classifier, Lane, LaneOrder,
                                                              LaneTag, lane_order)
from laneserve.policies.prefill.mechanisms.priority import make_predictor, priority_key
from laneserve.policies.registry import register

Mode = Literal["temporal", "spatial"]
MODES = get_args(Mode)
MIXED = "mixed"                  # a merged step's lane label
#: the paper's mechanisms without the do-no-harm guards (``laps-literal``; the ablation presets
#: ``laps-noawd`` / ``-nobuckets`` / ``-preempt`` / ``-offline`` are ablations of this one)
LITERAL = {"awd": True, "light_load": False, "order": "fcfs", "paid_padding": False, "merge": False,
           "step_slo_fraction": 0.0}


@dataclass(frozen=True, slots=True)
class LapsOptions(PrefillOptions):
    mode: Mode = "temporal"
    boundary: int | str = 256           # L_m in new tokens, or a classifier rule name
    awd: bool = False
    deadline_free: bool = False
    order: str = "edf"                  # lane order (checked by the lane-order factory)
    long_chunk: int = 2048
    long_batch: Literal["fill", "single"] = "fill"
    short_budget: int = 2048
    shape_buckets: bool = True
    max_short_streak: int = 4
    lane: Literal["short", "long"] | None = None
    sla_guard: bool = True
    preempt: Literal["none", "operator", "layer"] = "none"
    w_min: float = 0.0
    w_max: float = 0.03
    delta: float = 0.02
    sigma: float = 0.05
    t_max: float = 0.1
    short_tokens: int | None = None
    light_load: bool = True
    paid_padding: bool = True           # pad to a captured shape only where graph replay pays
    merge: bool = True                  # short lane + long chunks in one step while shorts keep slack
    step_slo_fraction: float = 0.45     # long steps grow while <= this x the tightest TTFT (0: fixed)

    def validate(self) -> None:
        PrefillOptions.validate(self)
        for name in ("long_chunk", "short_budget", "max_short_streak"):
            at_least(self, name, 1)
        within(self, "step_slo_fraction", 0.0, 1.0)


@register("prefill", "laps", aliases={"laps-offline": {**LITERAL, "deadline_free": True, "long_chunk": 8192},
                                      "laps-noawd": {**LITERAL, "awd": False},
                                      "laps-nobuckets": {**LITERAL, "shape_buckets": False},
                                      "laps-preempt": {**LITERAL, "preempt": "operator"},
                                      "laps-literal": LITERAL})
class LapsPrefill(PrefillScheduler):
    name = "laps"
    Options = LapsOptions
    options: LapsOptions

    def __init__(self, kv, options: LapsOptions | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        mode, boundary, order, deadline_free = o.mode, o.boundary, o.order, o.deadline_free
        long_chunk, long_batch, short_budget, preempt = o.long_chunk, o.long_batch, o.short_budget, o.preempt
        self.mode = mode
        self.classifier = Classifier(boundary)
        lane_ord = self._lane_order(order)
        self.grid = ShapeGrid()
        # without prefix caching a waiting short request's new tokens are fixed: count the short
        # lane per length bucket so that the batch walks stop once a bucket is exhausted
        size_class = None if self.prefix_caching else lambda r: self.grid.length_bucket(r.remaining_prefill)
        self.lanes = {SHORT: Lane(SHORT, lane_ord, size_class=size_class), LONG: Lane(LONG, lane_ord)}
        self.shape_buckets = o.shape_buckets
        self.awd_on = o.awd
        self.long_chunk, self.long_batch, self.short_budget = long_chunk, long_batch, short_budget
        self.max_short_streak = o.max_short_streak
        self.paid_padding, self.merge, self.step_slo_fraction = o.paid_padding, o.merge, o.step_slo_fraction
        self._min_slo = math.inf                     # tightest TTFT target seen (step sizing)
        self.merged_steps = 0
        self.sla_guard = o.sla_guard and not deadline_free
        self.preempt = preempt
        self._running_long: StepPlan | None = None     # the long plan executing now
        self._long_started = 0.0
        self._long_forced = False
        self._parked_long: StepPlan | None = None      # a preempted long plan, resumed next
        self.preemptions = 0
        self._cost_model = None
        self._long_seconds = 0.0                     # last long step's observed time
        self.guard_dispatches = 0
        cfg = AWDConfig(w_min=o.w_min, w_max=o.w_max, delta=o.delta, sigma=o.sigma, t_max=o.t_max,
                        deadline_free=deadline_free, token_target=o.short_tokens or short_budget,
                        light_load=o.light_load)
        self.awd = AdaptiveWaitDepth(cfg, depth_cap=min(self.grid.max_depth(short_budget),
                                                        self.max_batch_size), grid=self.grid)
        self.assigned_lane: str | None = None
        if o.lane is not None:
            self.set_lane(o.lane)
        self.name = f"laps-{mode}"
        self._wakeup: float | None = None
        self._short_streak = 0
        self._plan_lane: dict[int, str] = {}
        self.steps = {SHORT: 0, LONG: 0, MIXED: 0}
        self.padded_tokens = 0
        self.real_short_tokens = 0

    # ---- lanes ---------------------------------------------------------------------------
    def set_lane(self, lane: str | None) -> None:
        """Spatial mode: the pool this instance now serves (informational for draining; the
        router sends only this lane's requests)."""
        if lane not in (SHORT, LONG, None):
            raise ValueError(f"lane must be 'short', 'long' or None, got {lane!r}")
        self.assigned_lane = lane

    def lane_of(self, req: Request) -> str:
        tag = req.policy_state.of(LaneTag)
        lane = tag.lane
        if lane is None:
            history = req.prompt_len - self.new_tokens(req)
            lane = tag.lane = self.classifier.classify(self.new_tokens(req), history)
        return lane

    def _push(self, req: Request, now: float) -> None:
        lane = self.lane_of(req)
        self.lanes[lane].push(req, now)
        slo = req.slo.ttft
        if slo is not None and slo < self._min_slo:
            self._min_slo = slo
        if lane == SHORT:
            self.awd.on_arrival(now)

    def _remove(self, req: Request) -> None:
        parked = self._parked_long
        if parked is not None and any(c.request is req for c in parked.prefills):
            self._parked_long = None
            self._plan_lane.pop(parked.plan_id, None)
            if not req.prefill_done:                 # aborted mid-prompt: the engine drops the parked step
                self.dropped_plans.append(parked)
        for lane in self.lanes.values():
            if lane.remove(req):
                return

    # ---- scheduling ----------------------------------------------------------------------
    def next_wakeup(self) -> float | None:
        return self._wakeup

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        self._wakeup = None
        short, long_ = self.lanes[SHORT], self.lanes[LONG]
        short_due, reason = self._short_due(now) if short else (False, "")
        if not short_due and short and long_ and self.sla_guard and self._short_squeezed(now, token_budget):
            short_due, reason = True, "sla_guard"
        if short and long_ and self.merge and self.preempt == "none" and self._parked_long is None:
            plan = self._mixed_plan(now, token_budget)
            if plan is not None:
                return plan
        if short_due and long_ and self._short_streak >= self.max_short_streak:
            plan = self._long_plan(now, token_budget)       # let one long chunk through
            if plan is not None:
                self._short_streak = 0
                return self._start_long(plan, now, forced=True)
        if short_due:
            plan = self._short_plan(now, token_budget)
            if plan is not None:
                self._short_streak += 1
                self.guard_dispatches += reason == "sla_guard"
                self.awd.on_dispatch(now, len(plan.prefills), reason, queue_left=len(short) > 0)
                return plan
        if long_:                    # long requests stay in their lane until their prompt is done
            plan = self._long_plan(now, token_budget)
            if plan is not None:
                self._short_streak = 0
                return self._start_long(plan, now)
        return None

    def _start_long(self, plan: StepPlan, now: float, forced: bool = False) -> StepPlan:
        self._running_long, self._long_started, self._long_forced = plan, now, forced
        return plan

    def should_preempt(self, running: StepPlan, now: float) -> bool:
        """Stop the running long chunk for a short batch that is due, or whose slack the chunk's
        remaining time would eat (``preempt`` on only)."""
        if self.preempt == "none" or running is not self._running_long or self._long_forced \
                or not self.lanes[SHORT]:
            return False                 # a chunk let through by max_short_streak runs to its end
        if self._short_due(now)[0]:
            return True
        if not self.sla_guard:
            return False
        remaining = max(self._predict_long(running.prefills) - (now - self._long_started), 0.0)
        return self._squeezed_by(now, remaining)

    def _short_due(self, now: float) -> tuple[bool, str]:
        reqs = self.lanes[SHORT].ordered(now)
        if not self.awd_on:
            return True, "immediate"
        lane = self.lanes[SHORT]
        tokens = sum(self.new_tokens(r) for r in reqs[: self.awd.depth_cap])
        d = self.awd.decide(now, len(reqs), lane.min_deadline(), lane.min_arrival(), tokens)
        if not d.dispatch:
            self._wakeup = d.wake_at
            return False, ""
        return True, d.reason

    def _short_squeezed(self, now: float, token_budget: int | None) -> bool:
        """Would the next long chunk, run first, leave the tightest waiting short request ≤ σ slack?
        (Predicted from the lane as it stands; nothing is admitted here.)"""
        if self._parked_long is not None:
            return self._squeezed_by(now, self._predict_long(self._parked_long.prefills))
        return self._squeezed_by(now, self._predict_long(
            self._long_chunks(now, self._long_budget(now, token_budget), admit=False)))

    def _predict_long(self, chunks: list[PrefillChunk]) -> float:
        """A long step's time: the bound cost model, else the last long step observed."""
        if self._cost_model is None:
            return self._long_seconds
        return self._cost_model.prefill_time([(c.num_new_tokens, c.start) for c in chunks]) if chunks else 0.0

    def _squeezed_by(self, now: float, long_seconds: float) -> bool:
        min_deadline = self.lanes[SHORT].min_deadline()
        return min_deadline - (now + long_seconds + self.awd.service) <= self.awd.config.sigma

    def _short_plan(self, now: float, token_budget: int | None) -> StepPlan | None:
        reqs = self.lanes[SHORT].ordered(now)
        budget = min(self.short_budget, token_budget or self.short_budget)
        cap = min(self.awd.depth_cap, self.max_batch_size)
        head_bucket = None
        for r in reqs:                               # the head: first request that fits KV
            if self.admit(r, now):
                head_bucket = self.grid.length_bucket(self.new_tokens(r)) if self.shape_buckets else None
                head = r
                break
        else:
            return None
        chosen = [head]
        counts = self.lanes[SHORT].class_counts if self.lanes[SHORT].size_class is not None else None
        if head_bucket is None:                      # no captured shape: unpadded, by tokens
            tokens = self.new_tokens(head)
            floor = self._fewest_new_tokens(counts)
            # only the length buckets whose shortest member still fits the budget
            edge = self._bucket_floor
            walk = self.lanes[SHORT].walk_classes(lambda b: tokens + edge(b) <= budget)
            for r in reqs if walk is None else walk:
                if len(chosen) >= cap or tokens + floor > budget:
                    break
                n = self.new_tokens(r)
                if r is head or tokens + n > budget or not self.admit(r, now):
                    continue
                chosen.append(r)
                tokens += n
            return self._emit(chosen, None, SHORT)
        bucket_of = self.grid.length_bucket
        depth_cap = min(cap, max(1, budget // head_bucket))
        # members of the head's bucket not visited yet (a walk stops when none is left)
        left = counts[head_bucket] - 1 if counts is not None else math.inf
        for r in reqs:                               # same bucket first
            if len(chosen) >= depth_cap or left <= 0:
                break
            if r is not head and bucket_of(self.new_tokens(r)) == head_bucket:
                left -= 1
                if self.admit(r, now):
                    chosen.append(r)
        batch = self.grid.batch_bucket(len(chosen)) or len(chosen)
        if batch * head_bucket > budget:
            batch = len(chosen)
        left = sum(n for b, n in counts.items() if b is not None and b < head_bucket) \
            if counts is not None else math.inf
        for r in reqs:                               # free padding rows: smaller buckets
            if len(chosen) >= batch or left <= 0:
                break
            if r not in chosen and (bucket_of(self.new_tokens(r)) or math.inf) < head_bucket:
                left -= 1
                if self.admit(r, now):
                    chosen.append(r)
        shape = self.grid.shape(head_bucket, len(chosen))
        if self.paid_padding and not self._padding_pays(chosen, shape):
            shape = None
        return self._emit(chosen, shape, SHORT)

    def _padding_pays(self, chosen: list[Request], shape: tuple[int, int]) -> bool:
        """Do no harm: is the padded, graph-replayed batch predicted no slower than the same batch
        unpadded? (No bound cost model: pad, as the paper does. A model that knows nothing of
        graph replay, e.g. one learned online, never predicts a gain: no padding.)"""
        cm = self._cost_model
        if cm is None:
            return True
        length, batch = shape
        real = [(self.new_tokens(r), r.prompt_len - self.new_tokens(r)) for r in chosen]
        padded = [(length, start) for _, start in real] + [(length, 0)] * (batch - len(real))
        return graphed_prefill_time(cm, padded) <= cm.prefill_time(real)

    def _mixed_plan(self, now: float, token_budget: int | None) -> StepPlan | None:
        """Merge (do no harm; a departure from the paper's mutual exclusion): one step of the long
        budget, the short lane first (whole requests in lane order, unpadded, up to
        ``short_budget`` tokens), the rest long chunks in lane order, when its predicted end
        leaves every short request in it more than σ of slack. One step instead of two saves a
        step's fixed cost, and a short request waits no longer than for the long chunk it would
        otherwise queue behind. (Filling the step in one deadline order across both lanes, as
        CP-EDF does, lost two thirds of the goodput on ShareGPT.) None, and the paper's
        alternation decides, without a cost model to predict the step or when it would squeeze a
        short request."""
        cm = self._cost_model
        if cm is None:
            return None
        budget = self._long_budget(now, token_budget)
        room = min(self.short_budget, budget)
        shorts: list[Request] = []
        batch: list[tuple[int, int]] = []
        for r in self.lanes[SHORT].ordered(now):
            n = self.new_tokens(r)
            if n > room or len(shorts) >= self.max_batch_size:
                break
            shorts.append(r)
            batch.append((n, r.prompt_len - n))
            room -= n
        if not shorts:
            return None
        left = budget - sum(n for n, _ in batch)
        longs = self._long_chunks(now, left, admit=False) if left > 0 else []
        batch += [(c.num_new_tokens, c.start) for c in longs]
        if min(r.ttft_deadline for r in shorts) - (now + cm.prefill_time(batch)) <= self.awd.config.sigma:
            return None
        chunks = [self.chunk(r, r.remaining_prefill) for r in shorts if self.admit(r, now)]
        if not chunks:
            return None
        for c in chunks:
            self.lanes[SHORT].remove(c.request)
        tokens, n_short = sum(c.num_new_tokens for c in chunks), len(chunks)
        self.real_short_tokens += tokens
        if budget > tokens:
            chunks += self._long_chunks(now, budget - tokens, admit=True)
        plan = StepPlan(prefills=chunks, label=f"{self.name}:mixed")
        self._plan_lane[plan.plan_id] = MIXED
        self.merged_steps += 1
        self._short_streak = 0
        self.awd.on_dispatch(now, n_short, "merged", queue_left=len(self.lanes[SHORT]) > 0)
        return plan

    def _long_budget(self, now: float, token_budget: int | None) -> int:
        """Tokens of a long step: ``long_chunk``, or (``step_slo_fraction`` > 0, do no harm) the
        largest ``long_chunk · 2^k`` within the instance's token budget whose step, as the long
        lane stands, is predicted to take at most that fraction of the tightest TTFT target seen:
        long prompts are not cut into smaller chunks than the SLOs need (each step pays a fixed
        cost), and a request arriving behind a step still waits a bounded share of its target.
        Only while no short request waits: a queue of them (a burst) is served behind
        ``long_chunk`` steps (measured: 4096-token steps during bursts of short prompts lost a
        sixth of their attainment at 4 instances). Our rule: the paper advances long prefills by a
        fixed chunk C_l."""
        cap = token_budget or self.token_budget
        tokens = min(self.long_chunk, cap)
        cm = self._cost_model
        if not self.step_slo_fraction or cm is None or not math.isfinite(self._min_slo) \
                or self.lanes[SHORT]:
            return tokens
        allowed = self.step_slo_fraction * self._min_slo
        while tokens * 2 <= cap:
            chunks = self._long_chunks(now, tokens * 2, admit=False)
            if sum(c.num_new_tokens for c in chunks) <= tokens \
                    or cm.prefill_time([(c.num_new_tokens, c.start) for c in chunks]) > allowed:
                break
            tokens *= 2
        return tokens

    def _fewest_new_tokens(self, counts) -> int:
        """A lower bound on the new tokens of any short-lane request: the lower edge of the
        smallest length bucket present (counted lane), else 1."""
        if counts is None:
            return 1
        return min((self._bucket_floor(b) for b, n in counts.items() if n > 0), default=1)

    def _bucket_floor(self, bucket: int | None) -> int:
        """The fewest new tokens a request of length bucket ``bucket`` has (None: above all)."""
        lengths = self.grid.lengths
        if bucket is None:
            return lengths[-1] + 1
        i = lengths.index(bucket)
        return lengths[i - 1] + 1 if i else 1

    def _long_plan(self, now: float, token_budget: int | None) -> StepPlan | None:
        if self._parked_long is not None:            # resume the preempted chunk first
            plan, self._parked_long = self._parked_long, None
            return plan
        chunks = self._long_chunks(now, self._long_budget(now, token_budget), admit=True)
        if not chunks:
            return None
        plan = StepPlan(prefills=chunks, label=f"{self.name}:long", preemptible=self.preempt != "none",
                        preempt_granularity="layer" if self.preempt == "layer" else "operator")
        self._plan_lane[plan.plan_id] = LONG
        return plan

    def _long_chunks(self, now: float, budget: int, *, admit: bool) -> list[PrefillChunk]:
        """The next long step's chunks: ``budget`` tokens in lane order, the last one partial
        (one request with ``long_batch="single"``). ``admit=False`` only predicts them (the SLA
        guard, the merge): nothing is admitted, no KV reserved."""
        chunks: list[PrefillChunk] = []
        for r in self.lanes[LONG].ordered(now):
            if budget <= 0 or len(chunks) >= self.max_batch_size:
                break
            if admit:
                if not self.admit(r, now):
                    continue
                chunk = self.chunk(r, budget)
            else:
                new = self.new_tokens(r)
                chunk = PrefillChunk(r, r.prompt_len - new, min(new, budget))
            chunks.append(chunk)
            budget -= chunk.num_new_tokens
            if self.long_batch == "single":
                break
        return chunks

    def _emit(self, chosen: list[Request], shape: tuple[int, int] | None, lane: str) -> StepPlan:
        for r in chosen:
            self.lanes[lane].remove(r)
        plan = StepPlan(prefills=[self.chunk(r, r.remaining_prefill) for r in chosen],
                        padded_shape=shape, label=f"{self.name}:{lane}")
        self._plan_lane[plan.plan_id] = lane
        if shape is not None:
            self.padded_tokens += shape[0] * shape[1]
        self.real_short_tokens += plan.num_prefill_tokens
        return plan

    # ---- after a step --------------------------------------------------------------------
    # ---- composition: FlowPrefill's slack-aware orders inside each lane ----------------------
    def _lane_order(self, order: str) -> LaneOrder:
        """``fcfs``/``edf`` (static), or ``sedf``/``dedf`` — FlowPrefill's sgn(slack)/deadline
        priorities, whose slack needs a TTFT prediction of the remaining tokens: a polynomial
        fitted to the instance's cost model (:meth:`bind_cost_model`) or, without one, learned
        online from this instance's completed steps."""
        if order not in ("sedf", "dedf"):
            self.predict, self._online = None, False
            return lane_order(order)
        self.predict, self._online = make_predictor(None, None)
        return LaneOrder(order, lambda r, now: priority_key(order, r, now, self.predict(r.remaining_prefill)),
                         dynamic=True)

    def bind_cost_model(self, cost_model) -> None:
        self._cost_model = cost_model
        if self._online:
            self.predict, self._online = make_predictor(None, cost_model)

    def update(self, plan: StepPlan, result, now: float):
        if self._online and result.completed and plan.prefills:
            self.predict.observe(plan.num_prefill_tokens, result.duration)
        lane = self._plan_lane.pop(plan.plan_id, None)
        if plan is self._running_long:
            self._running_long = None
        outcome = super().update(plan, result, now)
        if not result.completed:                    # preempted at a boundary: resume it later
            self._plan_lane[plan.plan_id] = lane
            if lane == LONG:
                self._parked_long = plan
                self.preemptions += 1
            return outcome
        if lane is not None:
            self.steps[lane] += 1
        if lane == SHORT:
            self.awd.on_service(result.duration)
        elif lane == LONG:
            self._long_seconds = result.duration
        if len(plan.prefills) == 1:
            c = plan.prefills[0]
            new = plan.padded_shape[0] if plan.padded_shape else c.num_new_tokens
            self.classifier.observe(new, c.start, result.duration)
        return outcome

    @property
    def num_running(self) -> int:
        return 0
