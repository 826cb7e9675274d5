"""Captured batch shapes: the grid of ``(L, B)`` (tokens per request, batch size) both the engine
(which pads a step to one and replays a captured graph for it) and the LAPS short-prefill lane
(which forms batches to fit one) read.

A neutral module below both, so the engine never imports a policy's internals to learn its
shapes. A batch is padded to the nearest shape at or above it (:meth:`ShapeGrid.shape`); a batch no
shape covers runs unpadded. The default grid is powers of two, ``L in {8..256}``,
``B in {1..64}``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

POW2_LENGTHS: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
POW2_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class ShapeGrid:
    """The captured ``(L, B)`` shapes: every pair of ``lengths × batches``."""

    lengths: tuple[int, ...] = POW2_LENGTHS
    batches: tuple[int, ...] = POW2_BATCHES

    def __post_init__(self) -> None:
        if not self.lengths or not self.batches or list(self.lengths) != sorted(set(self.lengths)) \
                or list(self.batches) != sorted(set(self.batches)) or self.lengths[0] < 1 or self.batches[0] < 1:
            raise ValueError("shape grid lengths and batches must be non-empty, increasing, positive")

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    def length_bucket(self, tokens: int) -> int | None:
        """The smallest captured length ≥ ``tokens`` (None when longer than every bucket)."""
        i = bisect_left(self.lengths, tokens)
        return self.lengths[i] if i < len(self.lengths) else None

    def batch_bucket(self, size: int) -> int | None:
        i = bisect_left(self.batches, size)
        return self.batches[i] if i < len(self.batches) else None

    def shape(self, max_tokens: int, size: int) -> tuple[int, int] | None:
        """Nearest captured shape covering a batch of ``size`` requests of ≤ ``max_tokens`` new
        tokens each (NEARESTGRAPH), or None."""
        length, batch = self.length_bucket(max_tokens), self.batch_bucket(size)
        return None if length is None or batch is None else (length, batch)

    def max_depth(self, budget_tokens: int) -> int:
        """Line 1 of Algorithm 1: the deepest captured batch whose memory (``L·B`` tokens at the
        smallest L) fits the budget ``M``."""
        fitting = [b for b in self.batches if b * self.lengths[0] <= budget_tokens]
        return fitting[-1] if fitting else self.batches[0]

    def depth_floor(self, size: int) -> int:
        """The largest captured batch size ≤ ``size`` (at least the smallest one)."""
        fitting = [b for b in self.batches if b <= size]
        return fitting[-1] if fitting else self.batches[0]

    def depth_up(self, depth: int, cap: int) -> int:
        nxt = self.batch_bucket(depth + 1)
        return min(nxt, cap) if nxt is not None else cap
