"""Kairos urgency-based prefill (the Kairos paper, §3.1, Algorithms 1–2): the literal algorithm
(``kairos-literal`` and its ablation presets) and the registered ``kairos``, a version that does
no harm.

The literal algorithm (:class:`KairosPrefill`), every step:

1. Algorithm 2 — estimate each queued request's prefill finish time by simulating FCFS from now:
   walk the queue in arrival order with a cursor ``t = max(t, r'.t_arrive) + n_r' / μ`` where
   ``n_r'`` is the request's remaining prompt tokens and ``μ`` the running throughput estimate.
2. Algorithm 1 lines 7–8 — ``slack_r = SLO_r − (t̂_finish − t_arrive)`` and the score
   ``u_r = (slack_r / SLO_r) / input_len_r``.
3. Lines 11–20 — sort by ``u`` **descending** (what the pseudo-code says) and fill the fixed chunk
   budget ``C``: whole requests while they fit, then the first one that does not fit takes the
   remaining ``C − c_used`` tokens and the step is full (line 18 sets ``C ← c_used``).
4. Line 22 — after the step, fold (tokens computed, step seconds) into ``μ``.

Choices where the paper is silent or inconsistent (say so in reports):

- Sort order. The text calls ``u`` "urgency" and says short requests are picked first because
  their score is "amplified by its shorter length"; that holds for positive slack, but with
  negative slack the same division makes short late requests the *most negative* and sorts them
  last. The literal default follows the pseudo-code (``order="descending"``); ``order="ascending"``
  (alias ``kairos-asc``) is the opposite order, measured as an ablation.
- ``input_len`` in the budget test (line 13) is taken as the request's *remaining* prompt tokens
  (chunked prefill continues partially prefilled requests); the score divides by the full prompt.
- ``μ`` is the cumulative mean throughput (tokens computed / seconds busy) over completed steps,
  or an exponential moving average with weight ``mu_ema`` when > 0. Before the first step it is
  ``throughput=`` if given, else the bound cost model's throughput at ``C`` tokens, else 10⁴ tok/s.
- A request without a TTFT target scores 0. Requests whose KV does not fit now are skipped for
  this step (order is not admission).
- ``C`` defaults to 8192 tokens (SGLang's default chunked-prefill size on 80 GB GPUs; the paper
  does not give its value).
- Diagnostic, not the paper: ``estimate="cost"`` (alias ``kairos-costest``) replaces ``n_r' / μ`` in
  the FCFS walk with the bound cost model's time for the request's remaining chunk, to measure how
  much the constant-throughput estimate costs on a model whose prefill time is superlinear.

The registered ``kairos`` (:class:`GuardedKairosPrefill`) keeps the mechanism — μ learned from its
own steps, Algorithm 2's finish estimates, the length-normalised score, whole requests then one
partial chunk — and departs from the paper where the policy league measured the literal one losing
to the baselines (the figures: docs/design.md, "Kairos: what the league measured"):

- **A request that cannot make its target goes last.** When even alone, started now, it would
  finish after its deadline (``max(arrival, now) + n_r / μ``), it cannot count towards attainment;
  serving it first only makes others late. These requests run in deadline order after the rest,
  so they still finish (no starvation while the instance has spare capacity), and Algorithm 2's
  walk skips them.
- **Deadline order unless length blocks.** The live requests run in deadline order (EDF), and
  Kairos' score orders them only while (a) every request this instance has seen shares one TTFT
  target — the setting the paper evaluates, where EDF is FCFS and blind to length — and (b) a
  queued prompt would take at least half of that target by itself (``HOL_SHARE``), the
  head-of-line blocking the length normalisation is for (``rank="auto"``; ``rank="urgency"`` /
  ``"edf"`` force either). With per-class or per-request targets the targets already encode the
  priorities, and dividing by length a second time cost goodput. With one target but no prompt
  long against it, the score lost to FCFS order; where the longest prompts take about the whole
  target (the Kairos setup) it gains. ``HOL_SHARE`` sits between the largest own-prefill / target
  of the workloads where it lost and that setup.
- **In the urgency order, the late go first.** Algorithm 2 estimates finish times under FCFS, but
  the queue is not served in FCFS order, so a request the walk calls on time can be passed over by
  higher scores until it is too late. The finish times are re-walked in the score order itself;
  requests late in that walk (but not hopeless) run first, in deadline order, then the rest by the
  descending score. Late requests are never sorted by the negative score, so the pseudo-code's
  "short late requests last" cannot happen.
- **Finish times from the instance's predictor.** With a cost model bound (``estimate="auto"``:
  the run's predictor, learned online from the instance's own steps by default) a request takes
  the predicted time of its remaining chunk instead of ``n_r / μ``; one mean throughput misjudged
  the short re-prefills of a prefix-cached chat workload. Without a cost model it falls back to
  ``n_r / μ``.
- **No guard on an untrained predictor.** For its first ``warmup`` (8) completed steps the
  instance's predictor is still its prior (a deliberately slow generic model), so nothing is
  called hopeless and the order is plain deadline order: a burst that arrives all at once would
  otherwise be decided on the prior alone.
- **``C`` = 2048 tokens** (``chunk=``), the chunk of the CP-EDF baseline: an 8K chunk let one long
  prompt hold short ones for a whole long step (``kairos-literal``'s 8192 stays available).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Request
from laneserve.policies.base import StepOutcome
from laneserve.policies.options import above, at_least, build_options, default_to, option_error
from laneserve.policies.prefill.base import PrefillOptions, PrefillScheduler
from laneserve.policies.prefill.mechanisms.kairos_slots import ArrivalSlots, linear_prefill_times
from laneserve.policies.registry import register

INF = float("inf")
SAME_TARGET = 1e-9      # relative TTFT spread under which the requests count as one target
HOL_SHARE = 0.5         # a prompt whose prefill takes this share of its target can block the rest
DEFAULT_THROUGHPUT = 1.0e4     # tokens/s before anything was observed or bound
BATCH_DURATIONS = 64           # touched requests above which their durations are computed at once


def _arrival_key(req: Request) -> tuple[float, int]:
    return (req.arrival_time, req.request_id)


def fcfs_finish_times(queue: list[Request], now: float, throughput: float,
                      duration: Any = None) -> list[float]:
    """Algorithm 2 for every request of ``queue`` (sorted by arrival) at once: the prefix sums of
    the FCFS walk (each request's estimate includes everyone who arrived before it). Each request
    takes ``remaining_prefill / throughput``, or ``duration(req)`` when given."""
    cursor = now
    out = []
    for r in queue:
        if r.arrival_time > cursor:
            cursor = r.arrival_time
        cursor += r.remaining_prefill / throughput if duration is None else duration(r)
        out.append(cursor)
    return out


def urgency_score(req: Request, finish: float) -> float:
    """Algorithm 1 lines 7–8: ``((SLO − (t̂_finish − t_arrive)) / SLO) / input_len``."""
    slo = req.slo.ttft
    if slo is None or slo == INF:
        return 0.0
    return ((slo - (finish - req.arrival_time)) / slo) / req.prompt_len


def best_first(slots: ArrivalSlots, primary: np.ndarray, mask: np.ndarray,
               skip: Callable[[], float] | None = None) -> Iterator[Request]:
    """The requests of the slots in ``mask`` by ascending ``primary`` (ties: arrival, id), lazily:
    exact order of the best ``m`` remaining (ties included), ``m`` growing only if the caller asks
    for more. ``skip`` (read before each request): a prompt length from a KV refusal; from when it
    falls, the slots not started (``slots.fresh``) at least that long are left out in one pass,
    those the caller's :meth:`~.base.PrefillScheduler.refused_by_bound` would pass over one by one."""
    n = slots.n
    mask = mask.copy()                  # the slots still to yield
    primary = np.where(mask, primary, np.inf)
    arr, rid = slots.arr[:n], slots.rid[:n]
    m, bound = 128, INF
    while (live := int(np.count_nonzero(mask))) > 0:
        if m >= live:
            idx = np.flatnonzero(mask)
        else:
            best = np.argpartition(primary, m - 1)[:m]
            idx = np.flatnonzero(mask & (primary <= primary[best].max()))
        order = idx[np.lexsort((rid[idx], arr[idx], primary[idx]))]
        for k, j in enumerate(order.tolist()):
            if skip is not None and (b := skip()) < bound:
                bound = b
                cut = mask & slots.fresh[:n] & (slots.plen[:n] >= b)
                if cut.any():           # re-rank what is left: the order of the rest is unchanged
                    cut[order[:k]] = True               # ...and what was yielded goes too
                    mask &= ~cut
                    primary[cut] = np.inf
                    break
            yield slots.reqs[j]
        else:
            mask[order] = False
            primary[order] = np.inf
            m *= 4


@dataclass(frozen=True, slots=True)
class KairosPrefillOptions(PrefillOptions):
    token_budget: int | None = None     # None: the chunk
    chunk: int = 8192
    order: Literal["descending", "ascending"] = "descending"
    throughput: float | None = None     # prior tokens/s (None: from the cost model)
    mu_ema: float = 0.0
    estimate: Literal["throughput", "cost"] = "throughput"

    def validate(self) -> None:
        at_least(self, "chunk", 1)
        default_to(self, "token_budget", "chunk")
        PrefillOptions.validate(self)
        above(self, "throughput", 0)
        if not 0.0 <= self.mu_ema < 1.0:
            raise option_error("mu_ema", "must be in [0, 1)", self.mu_ema)


@register("prefill", "kairos-literal", aliases={"kairos-desc": {"order": "descending"},
                                         "kairos-asc": {"order": "ascending"},
                                         "kairos-ascending": {"order": "ascending"},
                                         "kairos-costest": {"estimate": "cost"}})
class KairosPrefill(PrefillScheduler):
    """The literal algorithm (``kairos-literal`` and its ablations)."""

    name = "kairos"

    Options = KairosPrefillOptions
    options: KairosPrefillOptions

    def __init__(self, kv, options: KairosPrefillOptions | None = None, *, cost_model: Any = None,
                 **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        chunk, order, throughput, mu_ema, estimate = o.chunk, o.order, o.throughput, o.mu_ema, o.estimate
        self.chunk_size = chunk
        self.order = order
        self.estimate = estimate
        self._cost_model: Any = None
        self._model_version: int | None = None       # a learned model's refit count (estimate="cost")
        self.mu_ema = mu_ema
        self.name = f"kairos-{chunk}" + ("" if order == "descending" else "-asc")
        self.queue: list[Request] = []               # pending, in arrival order
        self.throughput = throughput or DEFAULT_THROUGHPUT
        self._prior_given = throughput is not None
        self._tokens_seen = 0
        self._seconds_seen = 0.0
        self._slots = ArrivalSlots()
        self._refused = INF                          # the deciding fill's KV refusal bound
        self._dirty: set[int] = set()                # ids whose remaining tokens may have changed
        self.recomputed = 0                          # durations re-read one request at a time
        if cost_model is not None:
            self.bind_cost_model(cost_model)

    def bind_cost_model(self, cost_model: Any) -> None:
        """Initial μ from the instance's cost model (a full chunk), unless given or observed; the
        ``estimate="cost"`` durations read it too (a learned one re-read when it refits)."""
        self._cost_model = cost_model
        self._dirty.update(r.request_id for r in self.queue)
        if not self._prior_given and self._seconds_seen == 0.0:
            self.throughput = self.chunk_size / cost_model.prefill_time([(self.chunk_size, 0)])

    def _push(self, req: Request, now: float) -> None:
        insort(self.queue, req, key=_arrival_key)
        self._enqueue_slot(req)

    def _remove(self, req: Request) -> None:
        queue = self.queue                      # sorted by arrival: find it by bisection
        i = bisect_left(queue, _arrival_key(req), key=_arrival_key)
        if i < len(queue) and queue[i] is req:
            del queue[i]
        self._drop_slot(req)

    # ---- the incremental columns (kairos_slots) ----------------------------------------------
    def _enqueue_slot(self, req: Request) -> None:
        slots = self._slots
        if slots.fits_after(req):
            slots.append(req)
        else:                                   # out of arrival order: filed at its place
            slots.insert(req)
        slots.set_fresh(req, req.times.prefill_start is None and req.request_id not in self.kv.tables)
        self._dirty.add(req.request_id)

    def _drop_slot(self, req: Request) -> None:
        self._slots.drop(req)
        self._dirty.discard(req.request_id)

    def _touch(self, req: Request) -> None:
        self._dirty.add(req.request_id)

    def _duration(self, req: Request) -> float:
        new = self.new_tokens(req)
        return self._cost_model.prefill_time([(new, req.prompt_len - new)])

    def _refresh(self) -> None:
        """Bring the slots' work columns up to date: the requests touched since the last decision,
        and every duration when a learned cost model refitted under ``estimate="cost"`` (at once,
        vectorised, for a linear model; one by one otherwise)."""
        slots = self._slots
        cost = self.estimate == "cost"
        if cost and self._cost_model is None:
            raise RuntimeError("kairos estimate='cost' needs a cost model (bind_cost_model)")
        version = getattr(self._cost_model, "prefill_version", None)
        if cost and version != self._model_version:
            self._model_version = version           # a learned model refitted: every duration is stale
            if not self._redo_durations():
                self._dirty.update(r.request_id for r in self.queue)
        dirty = self._dirty
        if cost and len(dirty) > BATCH_DURATIONS and self._batch_durations():
            return
        for rid in dirty:
            req = self.requests[rid]
            slots.set_work(req, self.new_tokens(req), self._duration(req) if cost else 0.0)
        if cost:
            self.recomputed += len(dirty)
        dirty.clear()

    def _redo_durations(self) -> bool:
        """Every queued request's duration at once, in a few vectorised passes over the columns
        (:func:`linear_prefill_times`, equal to the model's own per-request times); the requests
        touched since the last decision are re-read after it. False when the model is not linear."""
        slots = self._slots
        live = np.flatnonzero(slots.alive[:slots.n])
        times = linear_prefill_times(self._cost_model, slots.rem[live], slots.plen[live])
        if times is None:
            return False
        slots.dur[live] = times
        return True

    def _batch_durations(self) -> bool:
        """The touched requests' tokens one by one, their durations at once (many touched at once:
        a burst of arrivals filed since the last decision). False when the model is not linear
        (nothing done)."""
        slots, dirty = self._slots, self._dirty
        tokens = {rid: self.new_tokens(self.requests[rid]) for rid in dirty}
        idx = np.array([i for rid in dirty if (i := slots.slot.get(rid)) is not None], dtype=np.intp)
        plen = slots.plen[idx]
        new = np.array([float(tokens[slots.reqs[i].request_id]) for i in idx.tolist()])
        times = linear_prefill_times(self._cost_model, new, plen)
        if times is None:
            return False
        slots.rem[idx] = new
        slots.dur[idx] = times
        dirty.clear()
        return True

    def _step_seconds(self) -> np.ndarray:
        """Each slot's estimated prefill seconds: ``n_r / μ``, or the cost model's (``estimate="cost"``)."""
        slots = self._slots
        return slots.rem[:slots.n] / self.throughput if self.estimate == "throughput" else slots.dur[:slots.n]

    def _ranked(self, now: float) -> Iterator[Request]:
        """The queue in score order (as the reference's full sort), best first, lazily."""
        slots = self._slots
        self._refresh()
        if slots.max_arrival > now:          # the walk's cursor could jump: the plain walk
            yield from (r for _, r in self._sorted_scores(now))
            return
        n = slots.n
        finish = np.cumsum(np.concatenate(([now], self._step_seconds())))[1:]
        arr, slo = slots.arr[:n], slots.slo[:n]
        score = np.where(slots.has_slo[:n], ((slo - (finish - arr)) / slo) / slots.plen[:n], 0.0)
        yield from best_first(slots, -score if self.order == "descending" else score, slots.alive[:n],
                              self._refused_bound)

    # ---- Algorithm 1 -------------------------------------------------------------------------
    def scores(self, now: float) -> list[tuple[float, Request]]:
        if self.estimate == "cost":
            if self._cost_model is None:
                raise RuntimeError("kairos estimate='cost' needs a cost model (bind_cost_model)")
            duration = self._duration
        else:
            duration = lambda r: self.new_tokens(r) / self.throughput  # noqa: E731
        finishes = fcfs_finish_times(self.queue, now, self.throughput, duration)
        return [(urgency_score(r, f), r) for r, f in zip(self.queue, finishes)]

    def _sorted_scores(self, now: float) -> list[tuple[float, Request]]:
        scored = self.scores(now)
        sign = -1.0 if self.order == "descending" else 1.0
        scored.sort(key=lambda item: (sign * item[0], item[1].arrival_time, item[1].request_id))
        return scored

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        if not self.queue:
            return None
        return self._fill(self._ranked(now), now, token_budget)

    def _refused_bound(self) -> float:
        """The current decision's refusal bound (for :func:`best_first`'s ``skip``)."""
        return self._refused

    def _fill(self, ranked: Iterable[Request], now: float, token_budget: int | None) -> StepPlan | None:
        """Lines 11-20: whole requests in score order while they fit, then one partial chunk.
        A KV refusal's bound also reaches the ranking (``best_first``'s ``skip`` reads it): the
        requests the check below would pass over leave the ranking in one vectorised pass instead
        of being yielded one by one."""
        budget = self.chunk_size if token_budget is None else min(token_budget, self.chunk_size)
        plan = StepPlan(label=self.name)
        used = 0
        self._refused = INF    # a prompt this long found no KV: the not started as long are not asked
        for req in ranked:
            if used >= budget or len(plan.prefills) >= self.max_batch_size:
                break
            if self._refused != INF and self.refused_by_bound(req, self._refused):
                continue
            if not self.admit(req, now):
                bound = self.refusal_bound(req)
                if bound is not None:
                    self._refused = min(self._refused, bound)
                continue
            self._slots.set_fresh(req, False)
            self._touch(req)
            n = req.remaining_prefill
            if used + n <= budget:
                plan.prefills.append(self.chunk(req, n))
                used += n
            else:                                        # the partial chunk ends the step
                plan.prefills.append(self.chunk(req, budget - used))
                break
        return plan if plan.prefills else None

    # ---- line 22: UpdateThroughput -------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        if result.completed and result.duration > 0:
            tokens = plan.num_prefill_tokens
            observed = tokens / result.duration
            if self.mu_ema > 0.0 and self._seconds_seen > 0.0:
                self.throughput = (1.0 - self.mu_ema) * self.throughput + self.mu_ema * observed
            else:
                self._tokens_seen += tokens
                self._seconds_seen += result.duration
                self.throughput = self._tokens_seen / self._seconds_seen
        for chunk in plan.prefills:
            self._touch(chunk.request)
        return super().update(plan, result, now)


@dataclass(frozen=True, slots=True)
class GuardedKairosOptions(KairosPrefillOptions):
    chunk: int = 2048
    rank: Literal["auto", "urgency", "edf"] = "auto"
    estimate: Literal["auto", "throughput", "cost"] = "auto"     # auto: the bound predictor when there is one
    warmup: int = 8                     # completed steps before the guards trust the predictor

    def validate(self) -> None:
        KairosPrefillOptions.validate(self)
        at_least(self, "warmup", 0)


@register("prefill", "kairos")
class GuardedKairosPrefill(KairosPrefill):
    """Kairos urgency that does no harm (the registered ``kairos``): see the module docstring."""

    Options = GuardedKairosOptions
    options: GuardedKairosOptions

    def __init__(self, kv, options: GuardedKairosOptions | None = None, *, cost_model: Any = None,
                 **opts) -> None:
        o = build_options(GuardedKairosOptions, options, opts)     # needed before the parent's init
        self._auto_estimate = o.estimate == "auto"
        super().__init__(kv, o, cost_model=cost_model)
        if self.estimate == "auto":                  # no model bound yet: tokens / throughput until one is
            self.estimate = "throughput"
        self.rank = o.rank
        self._targets = (INF, 0.0)                   # lowest and highest TTFT target seen
        self.warmup = o.warmup
        self._steps_seen = 0
        self.name = f"kairos-guarded-{o.chunk}"

    def bind_cost_model(self, cost_model: Any) -> None:
        """As the literal one; with ``estimate="auto"`` the bound model (the run's predictor, learned
        online by default) times each request's remaining chunk from now on."""
        super().bind_cost_model(cost_model)
        if self._auto_estimate:
            self.estimate = "cost"

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        if not self.queue:
            return None
        self._refresh()
        return self._fill(self._guarded(now), now, token_budget)

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        if result.completed:
            self._steps_seen += 1
        return super().update(plan, result, now)

    def _use_urgency(self, blocking: np.ndarray) -> bool:
        """Kairos' urgency order while every request seen so far shares one TTFT target and a
        queued prompt would take a large share of it (``blocking``: the slots that would)."""
        if self.rank != "auto":
            return self.rank == "urgency"
        low, high = self._targets
        return high - low <= SAME_TARGET * high and bool(blocking.any())

    def _push(self, req: Request, now: float) -> None:
        slo = req.slo.ttft
        if slo is not None and slo != INF:
            low, high = self._targets
            self._targets = (min(low, slo), max(high, slo))
        super()._push(req, now)

    def _guarded(self, now: float) -> Iterator[Request]:
        slots = self._slots
        n = slots.n
        alive, has_slo = slots.alive[:n], slots.has_slo[:n]
        arr, slo, deadline = slots.arr[:n], slots.slo[:n], slots.deadline[:n]
        step = self._step_seconds()
        warm = self._steps_seen >= self.warmup           # before, the predictor is its prior: no guard
        hopeless = alive & (np.maximum(arr, now) + step > deadline) & warm
        live = alive & ~hopeless
        if warm and self._use_urgency(live & has_slo & (step >= HOL_SHARE * slo)):
            # Algorithm 2 over the requests that can still make it, cursor jumps included:
            # c_k = max(c_{k-1}, a_k) + d_k = S_k + max(now, max_{j<=k} a_j - S_{j-1})
            work = np.where(hopeless, 0.0, step)
            total = np.cumsum(work)
            finish = total + np.maximum(now, np.maximum.accumulate(arr - (total - work)))
            score = np.where(has_slo, ((slo - (finish - arr)) / slo) / slots.plen[:n], 0.0)
            urgency = -score if self.order == "descending" else score
            # late under the urgency order itself (not Algorithm 2's FCFS walk, which it does not follow)
            idx = np.flatnonzero(live)
            idx = idx[np.argsort(urgency[idx], kind="stable")]     # slots are in (arrival, id) order
            at_risk = np.zeros(n, dtype=bool)
            at_risk[idx] = now + np.cumsum(step[idx]) > deadline[idx]
            yield from best_first(slots, deadline, at_risk, self._refused_bound)
            yield from best_first(slots, urgency, live & ~at_risk, self._refused_bound)
        else:
            yield from best_first(slots, deadline, live, self._refused_bound)
        yield from best_first(slots, deadline, hopeless, self._refused_bound)
