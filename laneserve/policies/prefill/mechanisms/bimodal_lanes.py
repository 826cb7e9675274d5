"""LAPS' short/long lanes, in force only while the recent prompt lengths are bimodal: the
component :class:`BimodalLanes`, held by ``adaptive`` prefill (:mod:`..adaptive`) as
``self.lanes`` and handed to its Algorithm 1 (:class:`~.slo_batching.SLOAwareBatching`).

It watches the new-token lengths of the last ``window`` arrivals. They are bimodal when between
``min_share`` and ``1 − min_share`` of them are under the lane boundary L_m (``boundary``) and the
median of the rest is at least ``long_factor`` × L_m. While they are, a batch holds only requests
of its head's lane (LAPS' mutual exclusion: a long member makes every short one wait for its
compute).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from laneserve.core.request import Request
from laneserve.core.sorted_window import SortedWindow
from laneserve.policies.prefill.mechanisms.priority import PriorityKey
from laneserve.policies.prefill.mechanisms.sedf_queue import SignedDeadlineQueue


class BimodalLanes:
    def __init__(self, boundary: int, window: int, min_share: float, long_factor: float, *,
                 enabled: bool = True) -> None:
        self.boundary, self.min_share, self.long_factor = boundary, min_share, long_factor
        self.enabled = enabled
        self._lengths = SortedWindow(window)     # the new-token lengths of the last arrivals
        self.bimodal = False                     # lanes in force

    def observe(self, new_tokens: int) -> None:
        """An arrival of ``new_tokens`` new prompt tokens."""
        self._lengths.add(new_tokens)
        self.bimodal = self.enabled and self._lengths_bimodal()

    def _lengths_bimodal(self) -> bool:
        """Kept as arrivals come (a window of up to ``window`` lengths, sorted), so a decision
        costs O(1), not a pass and a sort over the window."""
        lengths = self._lengths
        size = len(lengths)
        if size < 16:
            return False
        short = lengths.count_below(self.boundary)
        share = 1 - (size - short) / size
        if not self.min_share <= share <= 1 - self.min_share:
            return False
        return lengths.median(short) >= self.long_factor * self.boundary    # the long lengths' median

    def candidates(self, queue: SignedDeadlineQueue, head: Request, head_key: PriorityKey,
                   bound: Callable[[], int], fresh_bound: Callable[[], float] | None = None) -> Iterable[Request]:
        """Algorithm 1's candidates while the lanes are in force, only from the head's lane: the
        other lane's requests would all be refused by :meth:`may_join`, and refusing them changes
        nothing Algorithm 1 decides (its batch and its stopping test move only when a request
        joins), so they are not walked one by one (a long head behind thousands of short prompts).
        Those not started at or above ``fresh_bound()`` tokens (which find no KV memory) may be
        left out too."""
        boundary = self.boundary
        if head.remaining_prefill < boundary:
            return queue.ordered_below(head_key, lambda: min(bound(), boundary), fresh_bound=fresh_bound)
        return queue.ordered_below(head_key, bound, floor=boundary, fresh_bound=fresh_bound)

    def may_join(self, head: Request, req: Request) -> bool:
        if not self.bimodal:
            return True
        return (head.remaining_prefill < self.boundary) == (req.remaining_prefill < self.boundary)
