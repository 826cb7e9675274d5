"""Clocks: wall time in the engine and server, virtual time in the simulator (docs/design.md,
"The central contract")."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Monotonic wall time in seconds since the clock was created."""

    __slots__ = ("_t0",)

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0


class VirtualClock:
    """A clock that reads a fixed time (``start``): drives an instance without wall time in tests."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t
