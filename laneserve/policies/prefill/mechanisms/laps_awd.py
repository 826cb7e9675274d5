"""LAPS §3.1–3.2: captured shape buckets and the Adaptive Wait-Depth (AWD) batching state of the
short-prefill lane (Algorithm 1, with the §3.2 window formula).

Shape buckets: the captured ``(L, B)`` grid of :class:`laneserve.core.shapes.ShapeGrid` (shared
with the engine). A short batch is padded to the nearest captured shape at or above it; a batch no
shape covers runs unpadded (the "standard prefill kernel" branch of Algorithm 1).

AWD keeps a target depth ``D`` (a captured batch size) and a wait window. At time ``t`` the
window of the batch being formed is

    W(t)    = clip(min(W_SLA(t), W_GR(t)), [W_min, W_max])
    W_SLA   = max(0, min_i(DDL_i − t − Ŝ) − δ)              (SLA-constrained mode only)
    W_GR    = max(0, D − depth) / max(r̂_s, ε)

and the batch is dispatched when ``depth ≥ D``, when the window expires, when the smallest slack
``min_i(DDL_i − (t + Ŝ)) ≤ σ`` or when the head of the line has waited more than ``T_max``.
Deadline-free mode replaces the window by token-max batching: dispatch when the tokens of the
batch reach ``M_s`` (``T_max`` and ``W_max`` still bound the wait, so the last requests of a run
leave too).

Choices where the paper is loose (documented here and in the report):

* The window is anchored at the moment batch formation starts (the first short request that
  finds the lane empty after a dispatch): the batch leaves at ``t0 + W_min`` at the earliest and
  ``t0 + W_max`` at the latest; in between, ``W_SLA`` and ``W_GR`` are re-evaluated from ``now``
  at every scheduling call (they are "remaining" times).
* Ŝ (service time of a short batch) is an EWMA of observed short-batch step times; r̂_s is an
  EWMA of short inter-arrival times, also fed by the observed fill rate ``depth/τ`` after each
  dispatch — this is how "W is updated from the observed fill time" (τ) enters.
* Do no harm at light load (``light_load=True``, default): when the short arrival
  rate is so low that the rest of the window is not expected to bring one more request
  (``r̂_s · (t0 + W_max − t) < 1``), waiting cannot grow the batch, only delay it, so the batch
  leaves at once (reason ``"light"``; not before ``W_min``): the wait depth collapses to what is queued. The paper's
  rule (always wait out the window) is ``light_load=False`` (``laps-literal``).
* Algorithm 1 only ever lowers ``D`` (``D ← d`` when the window expired first). We also raise it:
  when a batch reached ``D`` before its window expired, ``D`` moves up one grid step (up to the
  largest captured depth that fits the memory budget ``M``), so a load increase is followed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from laneserve.core.shapes import ShapeGrid


@dataclass(slots=True)
class AWDConfig:
    w_min: float = 0.0          # s, shortest window
    w_max: float = 0.03         # s, longest window
    delta: float = 0.02         # s, safety margin of W_SLA
    sigma: float = 0.05         # s, dispatch when the smallest slack falls to this
    t_max: float = 0.1          # s, longest head-of-line wait
    eps: float = 1e-3           # req/s, floor of the arrival-rate estimate
    ewma: float = 0.2           # weight of a new observation in the estimates
    service_init: float = 0.02  # s, Ŝ before any short batch ran
    deadline_free: bool = False
    token_target: int = 2048    # M_s: token-max dispatch threshold (deadline-free mode)
    light_load: bool = True     # dispatch at once when the window cannot bring another request

    def __post_init__(self) -> None:
        if not 0 <= self.w_min <= self.w_max:
            raise ValueError("need 0 <= w_min <= w_max")
        if self.t_max <= 0 or self.eps <= 0 or not 0 < self.ewma <= 1 or self.token_target < 1:
            raise ValueError("t_max, eps, token_target must be > 0 and ewma in (0, 1]")


@dataclass(slots=True)
class Decision:
    dispatch: bool
    reason: str = ""                 # "depth" | "window" | "slack" | "t_max" | "tokens" | "light"
    wake_at: float | None = None     # when to decide again if nothing happens before


@dataclass(slots=True)
class AdaptiveWaitDepth:
    """Mutable AWD state of one short lane."""

    config: AWDConfig
    depth_cap: int                                # largest captured depth within the budget M
    grid: ShapeGrid = field(default_factory=ShapeGrid)
    depth_target: int = 0                         # D
    rate: float = 0.0                             # r̂_s, short arrivals per second
    service: float = 0.0                          # Ŝ, seconds per short batch
    window_start: float | None = None             # t0 of the batch being formed
    expiry: float = math.inf                      # window end so far (only moves earlier)
    last_arrival: float | None = None
    dispatches: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.depth_target <= 0:
            self.depth_target = self.depth_cap
        if self.service <= 0:
            self.service = self.config.service_init

    # ---- observations --------------------------------------------------------------------
    def on_arrival(self, now: float) -> None:
        a = self.config.ewma
        if self.last_arrival is not None:         # EWMA of the gap (an EWMA of 1/gap is biased)
            gap = max(now - self.last_arrival, 1e-6)
            mean_gap = 1.0 / self.rate if self.rate > 0 else gap
            self.rate = 1.0 / ((1 - a) * mean_gap + a * gap)
        self.last_arrival = now
        if self.window_start is None:
            self.window_start = now

    def on_service(self, seconds: float) -> None:
        a = self.config.ewma
        self.service = (1 - a) * self.service + a * seconds

    def on_dispatch(self, now: float, depth: int, reason: str, queue_left: bool) -> None:
        """After a dispatch of ``depth`` requests: update D and r̂ from the observed fill."""
        self.dispatches += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        t0 = self.window_start if self.window_start is not None else now
        fill = now - t0
        if reason == "depth" or depth >= self.depth_target:
            self.depth_target = self.grid.depth_up(self.depth_target, self.depth_cap)
        elif reason == "window":
            self.depth_target = min(self.grid.depth_floor(depth), self.depth_cap)
        if fill > 0 and depth > 1:                # observed fill rate, same gap-EWMA form
            a = self.config.ewma
            mean_gap = 1.0 / self.rate if self.rate > 0 else fill / (depth - 1)
            self.rate = 1.0 / ((1 - a) * mean_gap + a * fill / (depth - 1))
        self.window_start = now if queue_left else None
        self.expiry = math.inf

    # ---- the decision --------------------------------------------------------------------
    def decide(self, now: float, depth: int, min_deadline: float, head_arrival: float,
               tokens: int) -> Decision:
        """Dispatch the short batch now? ``depth`` = short requests waiting, ``min_deadline`` =
        their earliest TTFT deadline, ``tokens`` = new tokens of the batch that would leave."""
        cfg = self.config
        if depth <= 0:
            return Decision(False)
        t0 = self.window_start if self.window_start is not None else now
        t_max_at = head_arrival + cfg.t_max
        if now >= t_max_at:
            return Decision(True, "t_max")
        latest = t0 + cfg.w_max
        if cfg.deadline_free:
            if tokens >= cfg.token_target:
                return Decision(True, "tokens")
            if now >= latest:
                return Decision(True, "window")
            return Decision(False, wake_at=min(latest, t_max_at))
        if depth >= self.depth_target:
            return Decision(True, "depth")
        if cfg.light_load and now >= t0 + cfg.w_min and self.rate * (latest - now) < 1.0:
            return Decision(True, "light")
        slack = min_deadline - (now + self.service)
        if slack <= cfg.sigma:
            return Decision(True, "slack")
        w_sla = max(0.0, slack - cfg.delta)
        w_gr = max(0, self.depth_target - depth) / max(self.rate, cfg.eps)
        expiry = min(self.expiry, latest, max(t0 + cfg.w_min, now + min(w_sla, w_gr)))
        self.expiry = expiry
        if now >= expiry:
            return Decision(True, "window")
        slack_at = min_deadline - self.service - cfg.sigma if math.isfinite(min_deadline) else math.inf
        return Decision(False, wake_at=min(expiry, t_max_at, slack_at))
