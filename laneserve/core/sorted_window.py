"""The last ``size`` values of a stream, kept sorted as they come (``insort``, and the value that
leaves the window removed by bisection): order statistics of a sliding window in O(1) per query,
O(``size``) memmove per value. Used by adaptive prefill (its lane switch watches the prompt
lengths) and adaptive decode's intake rule (output lengths and time per token)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque


class SortedWindow:
    __slots__ = ("_recent", "_sorted")

    def __init__(self, size: int) -> None:
        self._recent: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, value: float) -> None:
        recent, ordered = self._recent, self._sorted
        if len(recent) == recent.maxlen:
            del ordered[bisect_left(ordered, recent[0])]
        recent.append(value)
        insort(ordered, value)

    def count_below(self, bound: float) -> int:
        """Values in the window smaller than ``bound``."""
        return bisect_left(self._sorted, bound)

    def median(self, start: int = 0) -> float:
        """``statistics.median`` of the sorted values from rank ``start`` on (some must be left)."""
        s = self._sorted
        m = len(s) - start
        mid = start + m // 2
        return s[mid] if m % 2 else (s[mid - 1] + s[mid]) / 2

    def quantile(self, q: float) -> float:
        """The value ``q`` of the way up the sorted window (nearest rank below)."""
        s = self._sorted
        return s[int(q * (len(s) - 1))]
