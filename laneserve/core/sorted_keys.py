"""A sorted set of unique, totally ordered keys with O(log n) search, cheap insert and delete, and
in-order walks that survive deletions (the policies' queues keep their order per event instead of
re-sorting per decision).

The keys live in blocks of at most ``2 * LOAD`` (a "sorted list of sorted lists"): a search
bisects the block maxima, then one block; inserting or deleting moves at most one block's tail.
Unlike a heap with lazily deleted entries there is nothing to compact later, so no single call
pays for the deletions of others. Building from many keys at once is one ``sorted`` call (none
for keys known to be sorted: :meth:`from_sorted`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

LOAD = 512


class SortedKeys:
    __slots__ = ("_blocks", "_maxes", "_len", "_version")

    def __init__(self, keys: Iterable[Any] = ()) -> None:
        ordered = sorted(keys)
        self._blocks = [ordered[i:i + LOAD] for i in range(0, len(ordered), LOAD)]
        self._maxes = [b[-1] for b in self._blocks]
        self._len = len(ordered)
        self._version = 0                  # bumped by every change: walks re-locate after one

    @classmethod
    def from_sorted(cls, ordered: list[Any]) -> SortedKeys:
        """The set of ``ordered``, a list already sorted without duplicates (not checked): no
        comparison at all, only the list cut in blocks."""
        keys = cls()
        keys._blocks = [ordered[i:i + LOAD] for i in range(0, len(ordered), LOAD)]
        keys._maxes = [b[-1] for b in keys._blocks]
        keys._len = len(ordered)
        return keys

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, key: Any) -> bool:
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return False
        block = self._blocks[i]
        j = bisect_left(block, key)
        return block[j] == key

    def first(self) -> Any | None:
        return self._blocks[0][0] if self._len else None

    def last(self) -> Any | None:
        return self._blocks[-1][-1] if self._len else None

    def add(self, key: Any) -> None:
        """Insert ``key`` (not already present)."""
        maxes, blocks = self._maxes, self._blocks
        self._len += 1
        self._version += 1
        if not maxes:
            blocks.append([key])
            maxes.append(key)
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):
            i -= 1
            blocks[i].append(key)
            maxes[i] = key
        else:
            insort(blocks[i], key)
        block = blocks[i]
        if len(block) > 2 * LOAD:
            blocks.insert(i + 1, block[LOAD:])
            del block[LOAD:]
            maxes.insert(i, block[-1])

    def remove(self, key: Any) -> None:
        """Delete ``key``; KeyError when absent."""
        maxes, blocks = self._maxes, self._blocks
        i = bisect_left(maxes, key)
        if i < len(maxes):
            block = blocks[i]
            j = bisect_left(block, key)
            if block[j] == key:
                del block[j]
                self._len -= 1
                self._version += 1
                if not block:
                    del blocks[i], maxes[i]
                    return
                maxes[i] = block[-1]
                if len(block) < LOAD // 4 and i + 1 < len(blocks) and len(block) + len(blocks[i + 1]) <= LOAD:
                    block.extend(blocks[i + 1])           # keep blocks from thinning out
                    del blocks[i + 1], maxes[i]
                return
        raise KeyError(key)

    def _locate_after(self, key: Any) -> tuple[int, int]:
        """(block, index) of the first key greater than ``key``."""
        i = bisect_right(self._maxes, key)
        if i == len(self._maxes):
            return i, 0
        return i, bisect_right(self._blocks[i], key)

    def after(self, key: Any) -> Any | None:
        """The least key greater than ``key`` (which need not be present), or None."""
        i = bisect_right(self._maxes, key)
        if i == len(self._maxes):
            return None
        block = self._blocks[i]
        return block[bisect_right(block, key)]

    def before(self, key: Any) -> Any | None:
        """The greatest key less than ``key`` (which need not be present), or None."""
        i = bisect_left(self._maxes, key)
        if i < len(self._maxes):
            block = self._blocks[i]
            j = bisect_left(block, key)
            if j:
                return block[j - 1]
        return self._blocks[i - 1][-1] if i else None

    def partition(self, pred: Any) -> Any | None:
        """The least key for which ``pred`` is false, or None when it holds for every key;
        ``pred`` must hold on a prefix of the keys (true, then false). O(log n) calls of it."""
        maxes = self._maxes
        lo, hi = 0, len(maxes)
        while lo < hi:                        # the first block whose greatest key fails
            mid = (lo + hi) // 2
            if pred(maxes[mid]):
                lo = mid + 1
            else:
                hi = mid
        if lo == len(maxes):
            return None
        block = self._blocks[lo]
        a, b = 0, len(block) - 1              # block[b] fails
        while a < b:
            mid = (a + b) // 2
            if pred(block[mid]):
                a = mid + 1
            else:
                b = mid
        return block[a]

    def walk(self, after: Any = None) -> Iterator[Any]:
        """Keys in order, greater than ``after`` when it is given, lazily. Keys deleted during
        the walk are not yielded once deleted; keys added during it may be."""
        i, j = (0, 0) if after is None else self._locate_after(after)
        version = self._version
        last = after              # the last key yielded (the version only changes after a yield)
        while True:
            if version != self._version:
                i, j = self._locate_after(last)
                version = self._version
            blocks = self._blocks
            if i >= len(blocks):
                return
            block = blocks[i]
            if j >= len(block):
                i, j = i + 1, 0
                continue
            last = block[j]
            j += 1
            yield last

    def to_list(self) -> list[Any]:
        """All keys in order, as one list (copied in C, no per-key Python step)."""
        return list(chain.from_iterable(self._blocks))

    def __iter__(self) -> Iterator[Any]:
        """All keys in order (no changes during the iteration: use :meth:`walk` for that)."""
        for block in self._blocks:
            yield from block

    def __reversed__(self) -> Iterator[Any]:
        for block in reversed(self._blocks):
            yield from reversed(block)
