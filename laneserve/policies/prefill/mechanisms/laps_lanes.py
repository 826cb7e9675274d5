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

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from heapq import heapify, heappop, heappush

from laneserve.core.request import Request
from laneserve.core.sorted_keys import SortedKeys
from laneserve.costmodel.laps_fit import LapsPrefillModel

SHORT, LONG = "short", "long"
LANES = (SHORT, LONG)


@dataclass(slots=True)
class LaneTag:
    """A request's LAPS lane (``req.policy_state.of(LaneTag)``): set by the ``laps-pools`` router
    or, when it comes untagged, by LAPS prefill on first sight."""

    lane: str | None = None


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
    """One lane's queue of not-yet-finished prefills, in the lane order. A static order keeps the
    list sorted (insertion and removal find their place by bisection); the earliest TTFT deadline
    and arrival are kept in sorted sets (AWD asks for them at every decision; deleted eagerly, so
    no decision pays for compacting the others' removals)."""

    name: str
    order: LaneOrder
    items: list[Request] = field(default_factory=list)
    #: optional size class of a request (static while it waits): members are counted per class
    size_class: Callable[[Request], Any] | None = None
    class_counts: Counter = field(default_factory=Counter)
    _by_class: dict[Any, list[Request]] = field(default_factory=dict)   # static order: per class
    _members: set[int] = field(default_factory=set)
    _deadlines: SortedKeys = field(default_factory=SortedKeys)    # (TTFT deadline, id)
    _arrivals: SortedKeys = field(default_factory=SortedKeys)     # (arrival, id)
    _filed: dict[int, tuple[tuple, tuple]] = field(default_factory=dict)   # id -> its two keys

    def push(self, req: Request, now: float) -> None:
        if self.order.dynamic:
            self.items.append(req)
        else:
            insort(self.items, req, key=lambda r: self.order.key(r, now))
        self._members.add(req.request_id)
        if self.size_class is not None:
            c = self.size_class(req)
            self.class_counts[c] += 1
            if not self.order.dynamic:
                insort(self._by_class.setdefault(c, []), req, key=lambda r: self.order.key(r, now))
        filed = self._filed[req.request_id] = ((req.ttft_deadline, req.request_id),
                                               (req.arrival_time, req.request_id))
        self._deadlines.add(filed[0])
        self._arrivals.add(filed[1])

    def remove(self, req: Request) -> bool:
        if req.request_id not in self._members:
            return False
        items = self.items
        i = 0 if self.order.dynamic else bisect_left(items, self.order.key(req, 0.0),
                                                     key=lambda r: self.order.key(r, 0.0))
        if i < len(items) and items[i] is req:
            del items[i]
        else:
            items.remove(req)
        self._members.discard(req.request_id)
        if self.size_class is not None:
            c = self.size_class(req)
            self.class_counts[c] -= 1
            if not self.order.dynamic:
                members = self._by_class[c]
                del members[bisect_left(members, self.order.key(req, 0.0), key=lambda r: self.order.key(r, 0.0))]
        deadline, arrival = self._filed.pop(req.request_id)
        self._deadlines.remove(deadline)
        self._arrivals.remove(arrival)
        return True

    def walk_classes(self, eligible: Callable[[Any], bool]) -> Iterator[Request] | None:
        """The members of the size classes ``eligible`` accepts, in lane order, lazily
        (``eligible`` is asked again before each member; a class it rejects is dropped). None
        when the lane cannot do it (no size classes, or a dynamic order). No removals during
        the walk."""
        if self.size_class is None or self.order.dynamic:
            return None
        return self._walk_classes(eligible)

    def _walk_classes(self, eligible: Callable[[Any], bool]) -> Iterator[Request]:
        key, lists = self.order.key, self._by_class
        frontier = [(key(m[0], 0.0), i, c) for i, (c, m) in enumerate(lists.items()) if m]
        heapify(frontier)
        index = dict.fromkeys(lists, 0)
        while frontier:
            _, i, c = heappop(frontier)
            if not eligible(c):
                continue
            members, k = lists[c], index[c]
            yield members[k]
            k += 1
            index[c] = k
            if k < len(members):
                heappush(frontier, (key(members[k], 0.0), i, c))

    def min_deadline(self) -> float:
        """The earliest TTFT deadline in the lane (the lane must not be empty)."""
        return self._deadlines.first()[0]

    def min_arrival(self) -> float:
        """The earliest arrival in the lane (the lane must not be empty)."""
        return self._arrivals.first()[0]

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
