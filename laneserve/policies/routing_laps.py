"""LAPS spatial disaggregation (LAPS §3.2, Algorithm 2): a short pool and a long pool of
prefill instances, a router that sends each request to an instance of its lane's pool, and the
lightweight instance-pressure controller that moves one instance between pools at a time.

Router side (``laps-pools``): each arrival is classified by its new tokens against L_m: the prompt
minus the longest prefix an accepting instance holds (``cached_prefix``; with the simulator's
idealised flag-mode caching that is the request's ``prefix_len``; ``cached_prefix=false`` counts
the whole prompt), tagged with its lane (``LaneTag``) and sent to an instance of that lane's pool:
with ``affinity`` (default) to the pool instances that hold the longest cached prefix when it
covers ≥ ``affinity_threshold`` of the prompt and their queue is within ``balance_tokens`` of the
pool's shortest, and among those (or else among the whole pool) to the least-loaded (fewest queued
tokens, then fewest waiting, then least recently picked). Affinity is ours: the paper's router
sends a request to its pool and says nothing of caches; without it a multi-turn session's
re-prefill lands wherever the load is lowest and loses its cached history. A request classified
short by a history that only a long-pool instance holds would be a long prefill on the short
instance it is routed to, so it goes to the long pool instead. The router is called on
every arrival with ``now``; when a control period has elapsed it first runs the controller.
Given decode instances (``--decode-router laps-pools``) it places as least-loaded does: the pools
are of prefill instances.

Per-instance signals over the last period (our concrete reading of "queue, SLA deviation,
utilisation"; all dimensionless so the two pools compare):

* ``q`` — backlog in SLO units, saturating at ``q_cap`` (2 SLOs: one huge prompt queued on a long
  instance says little about whether its pool needs another instance). ``backlog="wait"``
  (default): the age of the oldest request routed here and not started yet / the TTFT SLO — a
  direct measurement. ``backlog="tokens"``: queued prefill tokens / the instance's measured
  prefill rate (tokens per busy second, EWMA; the pool's mean until the instance has one) / the
  SLO; it overstates the short pool's backlog (small padded batches have a low token rate and AWD
  holds requests on purpose), kept the short pool at 5–6 of 8 instances on ShareGPT and lost to
  least-loaded routing (benchmarks/prefill_laps: 2502 vs 1410 violations);
* ``e`` — SLO deviation caused by waiting: the mean over requests whose first token came (or whose
  deadline passed) in the period of ``min(TTFT − SLO, queue wait)⁺ / SLO``. Only the waiting part
  counts: a prompt too long to ever meet the SLO should not pull instances into its pool;
* ``u`` — busy fraction of the period (from the instance's ``busy_time``; 0 if it has none).

``ψ = a·q + b·e − c·u`` (clipped at 0, then an EWMA over periods with weight ``smoothing``), pool
pressure = P90 over the pool (nearest rank). After the cool-down, if ``P_s > (1+τ)·P_l + floor``
and the long pool is above its minimum size, the short pool takes the least-loaded long instance
(and symmetrically). Two safeguards of ours against oscillation (seen without them: a move every
cool-down, back and forth): ``floor`` keeps two nearly idle pools (ψ ≈ 0) from trading instances
on noise, and a move is made only if the donor's pressure scaled to one instance fewer
(``P·n/(n−1)``) stays below the receiver's. A third, a capacity safeguard: the donor pool's busy
time (smoothed utilisation summed over its instances) spread over one instance fewer must stay
≤ ``max_util`` (0.85). Without it a pool busy at 85% but not yet queueing (ψ ≈ 0 — and the −c·u
term even lowers the pressure of busy instances) was stripped to its minimum and its backlog then
exploded (seen on ShareGPT: the long pool, 79% of the tokens, left with one of eight instances). A moved instance keeps its queued work and drains
it (see :mod:`laneserve.policies.prefill.laps`); its scheduler learns its new lane through
``scheduler.set_lane`` when the instance object exposes one.

Do no harm (``spill=True``, default; docs/design.md, "Do no harm"): a pool is never left idle or overloaded while
the other has room. When the lane pool's pick holds more than ``spill_tokens`` queued tokens above
the least-loaded live instance of either pool, the request goes to that instance instead (a
prefill instance runs both lanes, so a spilled request is served like any other). With the
default ``spill_tokens=0`` the pools only choose among the least-loaded instances (ties, e.g.
several idle ones), so a request goes to a busier instance than the least-loaded only for its
cached prefix (affinity, within ``balance_tokens``). Measured on league cells (4P+4D, online predictors, goodput / least-loaded's
with the same policies): with ``spill_tokens=2048`` 0.94 on the bursty short/long mix with LAPS
instances (0.20 in the league before LAPS merged its lanes: bursts of short prompts queued on the
two short-pool instances behind spilled long ones) and 0.88 on the multi-SLO mix with S-EDF
instances; with 256, 0.94-0.96 on the multi-SLO mix; with 0, >= 1.0 on the five workloads tried
(bursty, azure_conv, flowprefill, aligned95, multislo). Without any spill, on chat traffic where
nearly every prompt is long, the short pool sat idle and the router lost 30-40% of least-loaded's
goodput at 4 instances. ``laps-pools-literal`` (``spill=False``) is the paper's router: requests go
to their lane's pool whatever its load, and the controller alone rebalances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from laneserve.core.request import Phase, Request
from laneserve.policies.prefill.mechanisms.laps_lanes import LONG, SHORT, LaneTag
from laneserve.policies.options import PolicyOptions, above, at_least, option_error, within
from laneserve.policies.registry import register
from laneserve.policies.routing import InstanceLoad, LeastLoadedRouter, Router, affinity_candidates, cached_prefix


def p90(values: Sequence[float], q: float = 0.9) -> float:
    """Nearest-rank quantile (the robust aggregator A(·) of Algorithm 2)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(slots=True)
class PoolController:
    """Algorithm 2 on pool membership: ``pools[instance] = "short" | "long"``."""

    period: float = 2.0
    cool_down: float = 10.0
    tau: float = 0.5
    min_pool: int = 1
    floor: float = 0.2
    quantile: float = 0.9
    max_util: float = 0.85
    last_move: float = -math.inf
    moves: list[tuple[float, int, str, str]] = field(default_factory=list)  # (t, instance, from, to)

    def pool_pressure(self, pressures: dict[int, float], pools: dict[int, str], lane: str) -> float:
        return p90([pressures[i] for i, p in pools.items() if p == lane and i in pressures], self.quantile)

    def step(self, now: float, pressures: dict[int, float], pools: dict[int, str],
             load: dict[int, float] | None = None,
             utilization: dict[int, float] | None = None) -> tuple[int, str] | None:
        """One control period: the (instance, new lane) to move, applied to ``pools``, or None."""
        if now - self.last_move < self.cool_down:
            return None
        util = utilization or {}

        def can_give(lane: str, n: int) -> bool:
            # capacity safeguard: the donor's busy time spread over one instance fewer must fit
            busy = sum(util.get(i, 0.0) for i, p in pools.items() if p == lane)
            return n > self.min_pool and busy / (n - 1) <= self.max_util
        p_s = self.pool_pressure(pressures, pools, SHORT)
        p_l = self.pool_pressure(pressures, pools, LONG)
        n_s = sum(1 for p in pools.values() if p == SHORT)
        n_l = len(pools) - n_s
        # move only if the donor, one instance poorer (its load spread over n-1), would still be
        # under the receiver's pressure: otherwise the move just reverses the imbalance
        if p_s > (1 + self.tau) * p_l + self.floor and can_give(LONG, n_l) \
                and p_l * n_l / (n_l - 1) < p_s:
            src, dst = LONG, SHORT
        elif p_l > (1 + self.tau) * p_s + self.floor and can_give(SHORT, n_s) \
                and p_s * n_s / (n_s - 1) < p_l:
            src, dst = SHORT, LONG
        else:
            return None
        load = load or {}
        donor = min((i for i, p in pools.items() if p == src), key=lambda i: (load.get(i, 0.0), i))
        pools[donor] = dst
        self.last_move = now
        self.moves.append((now, donor, src, dst))
        return donor, dst


@dataclass(slots=True)
class _Stats:
    outstanding: list[Request] = field(default_factory=list)   # routed here, TTFT not yet judged
    rate: float | None = None        # prefill tokens per busy second (EWMA)
    busy_seen: float = 0.0
    last_pressure: float | None = None
    util: float | None = None        # busy fraction per period (EWMA)


@dataclass(frozen=True, slots=True)
class LapsPoolOptions(PolicyOptions):
    boundary: int = 256
    short_fraction: float = 0.5
    period: float = 2.0
    cool_down: float = 10.0
    tau: float = 0.5
    min_pool: int = 1
    floor: float = 0.2
    a: float = 1.0
    b: float = 1.0
    c: float = 0.1
    slo_ttft: float = 0.4
    cached_prefix: bool = True
    controller: bool = True
    q_cap: float = 2.0
    smoothing: float = 0.3
    backlog: Literal["wait", "tokens"] = "wait"    # queue waiting time, or tokens / rate
    affinity: bool = True
    affinity_threshold: float = 0.5
    balance_tokens: int = 16384
    spill: bool = True
    spill_tokens: int = 0            # 0: the pools choose among the least-loaded instances only

    def validate(self) -> None:
        PolicyOptions.validate(self)
        at_least(self, "spill_tokens", 0)
        within(self, "affinity_threshold", 0.0, 1.0)
        at_least(self, "balance_tokens", 0)
        at_least(self, "boundary", 1)
        within(self, "short_fraction", 0.0, 1.0)
        above(self, "period", 0)
        above(self, "slo_ttft", 0)
        if not 0 < self.smoothing <= 1:
            raise option_error("smoothing", "must be in (0, 1]", self.smoothing)


@register("router", "laps-pools", aliases={"laps": {}, "laps-pools-literal": {"spill": False}})
class LapsPoolRouter(Router):
    name = "laps-pools"

    Options = LapsPoolOptions
    options: LapsPoolOptions

    def __init__(self, options: LapsPoolOptions | None = None, **opts) -> None:
        super().__init__(options, **opts)
        o = self.options
        self.backlog = o.backlog
        self.spill, self.spill_tokens = o.spill, o.spill_tokens
        self.spills = 0
        self.affinity, self.affinity_threshold, self.balance_tokens = o.affinity, o.affinity_threshold, o.balance_tokens
        self.boundary, self.short_fraction = o.boundary, o.short_fraction
        self.weights = (o.a, o.b, o.c)
        self.slo_ttft, self.cached_prefix = o.slo_ttft, o.cached_prefix
        self.controller = PoolController(period=o.period, cool_down=o.cool_down, tau=o.tau, min_pool=o.min_pool,
                                         floor=o.floor)
        self.control_on = o.controller
        self.q_cap = o.q_cap
        self.smoothing = o.smoothing
        self.pools: dict[int, str] = {}           # index into the instance list -> lane
        self.stats: dict[int, _Stats] = {}
        self.last_tick: float | None = None
        self.history: list[dict] = []             # per period: pressures and pool sizes
        self._last_pick: dict[int, int] = {}
        self._picks = 0
        self._decode_side = LeastLoadedRouter()

    # ---- routing -------------------------------------------------------------------------
    def classify(self, req: Request, instances: Sequence[InstanceLoad] = ()) -> str:
        """Short or long by new tokens: the prompt minus the longest prefix an instance holds
        (``prefix_len`` when no instance is given); the whole prompt with ``cached_prefix=false``."""
        if not self.cached_prefix:
            return self._lane(req, 0)
        if instances:
            return self._lane(req, max(cached_prefix(inst, req) for inst in instances))
        return self._lane(req, req.prefix_len)

    def _lane(self, req: Request, cached: int) -> str:
        return SHORT if req.prompt_len - cached < self.boundary else LONG

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        if instances and instances[0].role == "decode":      # the pools are of prefill instances
            return self._decode_side.pick(instances, self._candidates(instances))
        if not self.pools:
            self._init_pools(instances)
        if self.last_tick is None:
            self.last_tick = now
        elif now - self.last_tick >= self.controller.period:
            self.tick(instances, now)
        live = self._candidates(instances)
        # one cache lookup per instance serves the lane, the affinity and the re-check below
        hits = {i: cached_prefix(instances[i], req) for i in live}
        tag = req.policy_state.of(LaneTag)
        tagged = tag.lane
        lane = tagged or self._lane(req, max(hits.values()) if self.cached_prefix else 0)
        choice = self._pick(instances, live, lane, req, hits)
        if lane == SHORT and self.cached_prefix and not tagged and self._lane(req, hits[choice]) == LONG:
            # the history it was classified by is held only outside the short pool: on the
            # instance it would run on it is a long prefill
            lane = LONG
            choice = self._pick(instances, live, lane, req, hits)
        tag.lane = lane
        last = self._last_pick
        self._picks += 1
        last[choice] = self._picks
        self.stats[choice].outstanding.append(req)
        return choice

    def _pick(self, instances: Sequence[InstanceLoad], live: list[int], lane: str, req: Request,
              hits: dict[int, int]) -> int:
        pool = [i for i in live if self.pools.get(i) == lane] or live
        holders = affinity_candidates(req, instances, pool, self.affinity_threshold, self.balance_tokens,
                                      hits) if self.affinity else None
        pool = holders or pool
        last = self._last_pick

        def load(i: int) -> tuple:
            return instances[i].queued_tokens, instances[i].num_waiting, last.get(i, -1), i
        choice = min(pool, key=load)
        if self.spill and not holders:       # a cache holder within balance_tokens keeps its request
            best = min(live, key=load)
            if instances[choice].queued_tokens - instances[best].queued_tokens > self.spill_tokens:
                self.spills += 1
                return best
        return choice

    def _init_pools(self, instances: Sequence[InstanceLoad]) -> None:
        n = len(instances)
        n_short = min(max(round(self.short_fraction * n), 1 if n > 1 else n), n - 1 if n > 1 else n)
        for i, inst in enumerate(instances):
            self.pools[i] = SHORT if i < n_short else LONG
            self.stats[i] = _Stats(busy_seen=float(getattr(inst, "busy_time", 0.0)))
            self._tell(inst, self.pools[i])

    @staticmethod
    def _tell(inst: InstanceLoad, lane: str) -> None:
        setter = getattr(inst, "set_lane", None)               # a remote instance's handle
        if setter is None:
            setter = getattr(getattr(inst, "scheduler", None), "set_lane", None)
        if setter is not None:
            setter(lane)

    # ---- the controller ------------------------------------------------------------------
    def signals(self, inst: InstanceLoad, stats: _Stats, now: float, period: float,
                pool_rate: float | None) -> tuple[float, float, float]:
        slo = self.slo_ttft
        busy = float(getattr(inst, "busy_time", 0.0))
        busy_delta, stats.busy_seen = max(busy - stats.busy_seen, 0.0), busy
        # one tight pass (every request routed here and not judged yet: O(queue) per period, as
        # the router learns of starts and first tokens only by looking at the requests)
        served, deviations, keep = 0, [], []
        oldest_wait = None                # age of the oldest kept request not started yet
        finished, aborted = Phase.FINISHED, Phase.ABORTED
        for r in stats.outstanding:
            t = r.times
            first = t.first_token
            age = now - r.arrival_time
            if first is None:
                if r.phase is finished or r.phase is aborted:
                    continue                                      # aborted / failed
                start = t.prefill_start
                if start is None and (oldest_wait is None or age > oldest_wait):
                    oldest_wait = age
                keep.append(r)                                    # still waiting (maybe late)
                if age <= slo:
                    continue
                over = age - slo
                if start is not None and start - r.arrival_time < over:
                    over = start - r.arrival_time
            else:
                start = t.prefill_start if t.prefill_start is not None else first
                over = first - r.arrival_time - slo
                if start - r.arrival_time < over:
                    over = start - r.arrival_time
                served += r.prompt_len - r.num_cached_tokens
            deviations.append((over if over >= 0.0 else 0.0) / slo)
        stats.outstanding = keep
        if busy_delta > 0 and served > 0:
            obs = served / busy_delta
            stats.rate = obs if stats.rate is None else 0.7 * stats.rate + 0.3 * obs
        if self.backlog == "wait":
            # the age of the oldest request not yet started here, in SLO units: measured directly,
            # so neither padding nor AWD's deliberate batching window distorts a rate estimate
            q = min((oldest_wait or 0.0) / slo, self.q_cap)
        else:
            rate = stats.rate or pool_rate
            # no rate measured anywhere yet: no backlog estimate (0), rather than a count in other units
            q = min(inst.queued_tokens / rate / slo, self.q_cap) if rate else 0.0
        e = sum(deviations) / len(deviations) if deviations else 0.0
        u = min(busy_delta / period, 1.0) if period > 0 else 0.0
        return q, e, u

    def tick(self, instances: Sequence[InstanceLoad], now: float) -> tuple[int, str] | None:
        period = now - (self.last_tick if self.last_tick is not None else now)
        self.last_tick = now
        if not self.pools:
            self._init_pools(instances)
        a, b, c = self.weights
        pools = self.pools
        pool_rate = {}
        for lane in (SHORT, LONG):
            rates = [self.stats[i].rate for i, p in pools.items() if p == lane and self.stats[i].rate]
            pool_rate[lane] = sum(rates) / len(rates) if rates else None
        pressures: dict[int, float] = {}
        for i, inst in enumerate(instances):
            q, e, u = self.signals(inst, self.stats[i], now, period, pool_rate[pools[i]])
            psi = max(a * q + b * e - c * u, 0.0)
            st = self.stats[i]                      # smoothed over periods (one period is noisy)
            st.util = u if st.util is None else (1 - self.smoothing) * st.util + self.smoothing * u
            st.last_pressure = psi if st.last_pressure is None else \
                (1 - self.smoothing) * st.last_pressure + self.smoothing * psi
            pressures[i] = st.last_pressure
        move = None
        if self.control_on:
            move = self.controller.step(now, pressures, pools,
                                        {i: float(inst.queued_tokens) for i, inst in enumerate(instances)},
                                        {i: st.util or 0.0 for i, st in self.stats.items()})
            if move is not None:
                self._tell(instances[move[0]], move[1])
        self.history.append({"t": now, "n_short": sum(1 for p in pools.values() if p == SHORT),
                             "p_short": self.controller.pool_pressure(pressures, pools, SHORT),
                             "p_long": self.controller.pool_pressure(pressures, pools, LONG)})
        return move
