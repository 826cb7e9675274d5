"""FlowPrefill's waiting queue in priority order, maintained per event instead of re-sorted per
decision (issue 12, item 1).

A request's key (:func:`~laneserve.policies.prefill.priority.sedf_key`) is static except for the
sign of its slack ``x = deadline − now − p`` (``p`` = TTFT̂ of its step tokens for S-EDF, 0 for
D-EDF), and that sign flips once, from + to −, when ``now`` passes ``deadline − p``. So:

- one sorted set (:class:`~laneserve.core.sorted_keys.SortedKeys`) of keys ``(0, d, arrival, id)``
  (slack ≥ 0), ``(1, 0, arrival, id)`` (no deadline) and ``(2, −d, arrival, id)`` (slack < 0): the
  group number leads, so its order is the full priority order;
- a sorted set of flip checks ``(deadline − p − tol, id)`` of the positive requests:
  :meth:`advance` walks those due and re-evaluates the sign with the exact float expression of the
  reference key (``tol`` covers the rounding difference between ``d − p`` and ``(d − now) − p``; a
  request still non-negative stays and is checked again next time); a flip moves one key;
- ``p`` of a request is computed when it enters (its step tokens do not change while it waits).

Every structure deletes eagerly (no dead entries, nothing to compact), so an event costs
O(log n) per request it adds, removes or flips. Work proportional to the queue happens only in
bulk, with one C sort: when many keys flip at once (more than a quarter of the queue, e.g. after
a long step) and on :meth:`rebuild`, which :meth:`advance` runs when the predictor was refitted
(its ``version`` changed) or ``now`` went backwards, and :meth:`set_predictor` after a new one.

``ordered`` walks the keys best first; requests may be removed during the walk. EDF and FCFS keys
never change. Every key is also filed in the sorted set of its *size class* (remaining prompt
tokens // ``BUCKET``): :meth:`ordered_below` merges only the classes that can hold a request
shorter than a bound that shrinks as Algorithm 1's batch grows, so the long prompts ahead of the
short ones are not walked one by one when none of them can fit any more.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from laneserve.core.request import Request
from laneserve.core.sorted_keys import SortedKeys
from laneserve.policies.prefill.priority import INF, ORDERINGS, PriorityKey

_FLIPPING = ("sedf", "dedf")
BUCKET = 128                 # tokens per size class of :meth:`SignedDeadlineQueue.ordered_below`


class SignedDeadlineQueue:
    def __init__(self, ordering: str, predict: Callable[[float], float],
                 step_tokens: Callable[[Request], int]) -> None:
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}")
        self.ordering = ordering
        self.predict = predict
        self.step_tokens = step_tokens
        self._reqs: dict[int, Request] = {}
        self._key: dict[int, PriorityKey] = {}         # key of every member
        self._p: dict[int, float] = {}                 # predicted seconds (flipping orderings)
        self._class_of: dict[int, int] = {}            # size class of each member
        self._flip: dict[int, tuple[float, int]] = {}  # flip check of each positive member
        self._rem: dict[int, tuple[int, int]] = {}     # (remaining prefill, id) as filed
        self._order = SortedKeys()
        self._classes: dict[int, SortedKeys] = {}      # size class -> its members' keys
        self._flips = SortedKeys()
        self._by_rem = SortedKeys()
        self._now = -INF
        self._version = getattr(predict, "version", None)

    # ---- membership ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._reqs

    def add(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._reqs:
            self.discard(rid)
        self._file(req)
        self._order.add(key := self._key[rid])
        c = self._class_of[rid]
        if c in self._classes:
            self._classes[c].add(key)
        else:
            self._classes[c] = SortedKeys((key,))
        self._by_rem.add(self._rem[rid])
        if rid in self._flip:
            self._flips.add(self._flip[rid])

    def _file(self, req: Request) -> None:
        """Record ``req``'s key, class, remaining tokens and flip check (not the sorted sets)."""
        rid = req.request_id
        self._reqs[rid] = req
        self._class_of[rid] = req.remaining_prefill // BUCKET
        self._rem[rid] = (req.remaining_prefill, rid)
        if self.ordering not in _FLIPPING:
            self._key[rid] = ORDERINGS[self.ordering](req, 0.0, 0.0)
            return
        d = req.ttft_deadline
        p = self.predict(self.step_tokens(req)) if self.ordering == "sedf" else 0.0
        self._p[rid] = p
        if d == INF:
            self._key[rid] = (1, 0.0, req.arrival_time, rid)
            return
        self._key[rid] = (0, d, req.arrival_time, rid)
        self._flip[rid] = (d - p - 1e-9 * (abs(d) + abs(p) + 1.0), rid)

    def discard(self, request_id: int) -> None:
        if self._reqs.pop(request_id, None) is None:
            return
        key = self._key.pop(request_id)
        self._order.remove(key)
        c = self._class_of.pop(request_id)
        members = self._classes[c]
        members.remove(key)
        if not members:
            del self._classes[c]
        self._by_rem.remove(self._rem.pop(request_id))
        flip = self._flip.pop(request_id, None)
        if flip is not None:
            self._flips.remove(flip)
        self._p.pop(request_id, None)

    # ---- time ------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Bring every key to ``now``: rebuild after a refit or a step back in time, then move the
        requests whose slack turned negative."""
        if self.ordering not in _FLIPPING:
            return
        version = getattr(self.predict, "version", None)
        if version != self._version or now < self._now:
            self._version = version
            self.rebuild()
        self._now = now
        self._settle(now)

    def _settle(self, now: float) -> None:
        keys, ps = self._key, self._p
        flipping = []
        for check in self._flips.walk():
            if check[0] > now:
                break
            rid = check[1]
            d = keys[rid][1]
            if d - now - ps[rid] < 0:                      # the reference's own expression
                flipping.append(rid)
        if len(flipping) > len(self._reqs) // 4:         # a burst: re-sort everything at once
            for rid in flipping:
                self._flip_key(rid)
            self._index()
            return
        for rid in flipping:
            old = keys[rid]
            self._flips.remove(self._flip[rid])
            new = self._flip_key(rid)
            self._order.remove(old)
            self._order.add(new)
            members = self._classes[self._class_of[rid]]
            members.remove(old)
            members.add(new)

    def _flip_key(self, rid: int) -> PriorityKey:
        """Turn ``rid``'s key negative (the sorted sets are the caller's)."""
        del self._flip[rid]
        old = self._key[rid]
        new = self._key[rid] = (2, -old[1], old[2], rid)
        return new

    def rebuild(self) -> None:
        """Re-predict every member and re-sort every structure (O(n log n), one C sort each):
        after a refit of the predictor; keys are positive again until the next :meth:`advance`."""
        members = list(self._reqs.values())
        self._reqs, self._key, self._p, self._class_of, self._flip, self._rem = {}, {}, {}, {}, {}, {}
        self._now = -INF
        for req in members:
            self._file(req)
        self._index()

    def _index(self) -> None:
        """Sort the sorted sets afresh from the per-member records."""
        self._order = SortedKeys(self._key.values())
        by_class: dict[int, list[PriorityKey]] = {}
        class_of = self._class_of
        for rid, key in self._key.items():
            by_class.setdefault(class_of[rid], []).append(key)
        self._classes = {c: SortedKeys(ks) for c, ks in by_class.items()}
        self._flips = SortedKeys(self._flip.values())
        self._by_rem = SortedKeys(self._rem.values())

    # ---- queries ---------------------------------------------------------------------------
    def top(self) -> tuple[PriorityKey, Request] | None:
        """The best member (call :meth:`advance` first)."""
        key = self._order.first()
        return None if key is None else (key, self._reqs[key[3]])

    def ordered(self) -> Iterator[tuple[PriorityKey, Request]]:
        """Members best first, lazily (call :meth:`advance` first; removals during the walk are
        fine)."""
        reqs = self._reqs
        for key in self._order.walk():
            yield key, reqs[key[3]]

    def ordered_below(self, after: PriorityKey, bound: Callable[[], int]) -> Iterator[Request]:
        """Members ranked after ``after`` whose remaining prompt tokens may be below ``bound()``,
        best first, lazily: ``bound`` is re-read at every step and may only shrink; a size class
        whose every member is at or above it is no longer walked (members of the boundary class
        may still be yielded: the caller checks each). Removals during the walk are fine."""
        reqs = self._reqs
        limit = bound()
        walks = {c: members.walk(after) for c, members in self._classes.items() if c * BUCKET < limit}
        frontier = []
        for c, walk in walks.items():
            key = next(walk, None)
            if key is not None:
                frontier.append((key, c))
        heapq.heapify(frontier)
        while frontier:
            key, c = frontier[0]
            if c * BUCKET >= limit:
                heapq.heappop(frontier)          # the class cannot fit any more: drop it
                continue
            yield reqs[key[3]]
            limit = bound()
            key = next(walks[c], None)
            if key is None:
                heapq.heappop(frontier)
            else:
                heapq.heapreplace(frontier, (key, c))

    def min_remaining(self) -> int | None:
        """The fewest remaining prompt tokens of any member."""
        by_rem, reqs = self._by_rem, self._reqs
        while by_rem:
            entry = by_rem.first()
            n, rid = entry
            left = reqs[rid].remaining_prefill
            if left == n:
                return n
            by_rem.remove(entry)                           # changed while queued: re-file it
            by_rem.add(refiled := (left, rid))
            self._rem[rid] = refiled
        return None

    def set_predictor(self, predict: Callable[[float], float]) -> None:
        """A new TTFT predictor (bound cost model): every key is rebuilt."""
        self.predict = predict
        self._version = getattr(predict, "version", None)
        self.rebuild()
