"""LAPS §3.2: the two length lanes (short queue Q_s, long queue Q_l), the classification of a
prefill by its NEW tokens against the boundary L_m (§2.1), and the pluggable order inside a lane.

Classification counts only the tokens this prefill computes: ``prompt − cached prefix`` (the
multi-turn history whose KV is reused is H, not L). ``boundary`` is either a fixed L_m (default
256) or a :class:`~laneserve.costmodel.laps_fit.LapsPrefillModel` fitted online from observed
``(L, H, T)`` steps, whose L_m depends on H (L_m^prefill at H = 0, L_m^re-prefill otherwise).

Lane orders are a registry: ``fcfs`` (arrival), ``edf`` (TTFT deadline). A policy elsewhere can
add one with :func:`register_lane_order` — e.g. FlowPrefill's S-EDF ``sgn(slack)/deadline`` as
``"sedf"`` — and LAPS picks it up by name (``laps:order=sedf``). A dynamic order (its key depends
on ``now``) is re-sorted at each scheduling call; a static one is kept sorted on insertion.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from laneserve.core.request import Request
from laneserve.costmodel.laps_fit import LapsPrefillModel

SHORT, LONG = "short", "long"
LANES = (SHORT, LONG)
LANE_TAG = "laps_lane"          # request tag: the lane a router (or this instance) assigned


@dataclass(frozen=True, slots=True)
class LaneOrder:
    """``key(req, now)``: smaller runs first. ``dynamic``: the key changes with ``now``."""

    name: str
    key: Callable[[Request, float], tuple]
    dynamic: bool = False


LANE_ORDERS: dict[str, LaneOrder] = {}


def register_lane_order(order: LaneOrder) -> LaneOrder:
    LANE_ORDERS[order.name] = order
    return order


register_lane_order(LaneOrder("fcfs", lambda r, now: (r.arrival_time, r.request_id)))
register_lane_order(LaneOrder("edf", lambda r, now: (r.ttft_deadline, r.arrival_time, r.request_id)))


def lane_order(name: str) -> LaneOrder:
    try:
        return LANE_ORDERS[name]
    except KeyError:
        raise ValueError(f"unknown LAPS lane order {name!r}; registered: {', '.join(sorted(LANE_ORDERS))}"
                         " (LapsPrefill adds 'sedf' and 'dedf', which need a TTFT predictor)") from None


@dataclass(slots=True)
class Lane:
    """One lane's queue of not-yet-finished prefills, in the lane order."""

    name: str
    order: LaneOrder
    items: list[Request] = field(default_factory=list)

    def push(self, req: Request, now: float) -> None:
        if self.order.dynamic:
            self.items.append(req)
        else:
            insort(self.items, req, key=lambda r: self.order.key(r, now))

    def remove(self, req: Request) -> bool:
        try:
            self.items.remove(req)
            return True
        except ValueError:
            return False

    def ordered(self, now: float) -> list[Request]:
        if self.order.dynamic:
            self.items.sort(key=lambda r: self.order.key(r, now))
        return self.items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.items)


class Classifier:
    """Short/long by new tokens against a fixed or fitted L_m."""

    def __init__(self, boundary: int | str = 256, *, default_boundary: int = 256, min_samples: int = 16,
                 refit_every: int = 32, max_samples: int = 512) -> None:
        self.fitted_mode = boundary == "fitted"
        if not self.fitted_mode:
            try:
                boundary = int(boundary)
            except (TypeError, ValueError):
                raise ValueError(f"boundary must be a token count or 'fitted', got {boundary!r}") from None
            if boundary < 1:
                raise ValueError("boundary must be >= 1 token")
        self.fixed = default_boundary if self.fitted_mode else int(boundary)
        self.model = LapsPrefillModel(default_boundary=float(self.fixed))
        self.samples: list[tuple[float, float, float]] = []
        self.min_samples, self.refit_every, self.max_samples = min_samples, refit_every, max_samples
        self._since_fit = 0

    def boundary(self, history: int = 0) -> float:
        return self.model.boundary(history) if self.fitted_mode else float(self.fixed)

    def classify(self, new_tokens: int, history: int = 0) -> str:
        return SHORT if new_tokens < self.boundary(history) else LONG

    def observe(self, new_tokens: int, history: int, seconds: float) -> None:
        """One single-request step (L, H, T); refit now and then (fitted mode only)."""
        if not self.fitted_mode or seconds <= 0 or new_tokens <= 0:
            return
        self.samples.append((float(new_tokens), float(history), float(seconds)))
        if len(self.samples) > self.max_samples:
            del self.samples[: len(self.samples) - self.max_samples]
        self._since_fit += 1
        distinct = len({(s[0], s[1]) for s in self.samples})
        if distinct >= self.min_samples and (not self.model.fitted or self._since_fit >= self.refit_every):
            self.model.fit(self.samples)
            self._since_fit = 0
