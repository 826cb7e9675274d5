"""FlowPrefill's waiting queue in priority order, maintained per event instead of re-sorted per
decision (issue 12, item 1).

A request's key (:func:`~laneserve.policies.prefill.priority.sedf_key`) is static except for the
sign of its slack ``x = deadline − now − p`` (``p`` = TTFT̂ of its step tokens for S-EDF, 0 for
D-EDF), and that sign flips once, from + to −, when ``now`` passes ``deadline − p``. So:

- one heap of keys ``(0, d, arrival, id)`` (slack ≥ 0), ``(1, 0, arrival, id)`` (no deadline) and
  ``(2, −d, arrival, id)`` (slack < 0): the group number leads, so the heap order is the full
  priority order; entries are deleted lazily (a key is live while ``_key[id]`` holds it);
- a heap of flip checks ``deadline − p − tol`` of the positive requests: :meth:`advance` pops
  those due and re-evaluates the sign with the exact float expression of the reference key
  (``tol`` covers the rounding difference between ``d − p`` and ``(d − now) − p``; a request still
  non-negative stays on a short "near" list and is checked again next time);
- ``p`` of a request is computed when it enters (its step tokens do not change while it waits);
  when the predictor is refitted (its ``version`` changes) or ``now`` goes backwards, every key is
  rebuilt (O(n log n), once per refit).

``ordered`` walks the heap array best-first (a second, small heap of frontier indices), so the
first ``k`` requests cost O(k log k) and the heap is not modified: requests may be removed during
the walk. EDF and FCFS keys never change and only use the first heap.

Every entry is also filed in a heap of its *size class* (remaining prompt tokens // ``BUCKET``):
:meth:`ordered_below` merges only the classes that can hold a request shorter than a bound that
shrinks as Algorithm 1's batch grows, so the long prompts ahead of the short ones are not walked
one by one when none of them can fit any more.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from laneserve.core.request import Request
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
        self._key: dict[int, PriorityKey] = {}        # live key of every member
        self._p: dict[int, float] = {}                 # predicted seconds (flipping orderings)
        self._heap: list[tuple[PriorityKey, Request]] = []
        self._classes: dict[int, list[tuple[PriorityKey, Request]]] = {}   # size class -> heap
        self._class_of: dict[int, int] = {}            # size class of each member
        self._flips: list[tuple[float, int, int]] = []  # (check time, seq, id) of positive members
        self._flip_seq: dict[int, int] = {}            # live flip check of each positive member
        self._seq = 0
        self._rem: list[tuple[int, int]] = []           # (remaining prefill, id), lazily deleted
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
        self._reqs[rid] = req
        self._class_of[rid] = req.remaining_prefill // BUCKET
        heapq.heappush(self._rem, (req.remaining_prefill, rid))
        if self.ordering not in _FLIPPING:
            self._set_key(req, ORDERINGS[self.ordering](req, 0.0, 0.0))
            return
        d = req.ttft_deadline
        p = self.predict(self.step_tokens(req)) if self.ordering == "sedf" else 0.0
        self._p[rid] = p
        if d == INF:
            self._set_key(req, (1, 0.0, req.arrival_time, rid))
            return
        self._set_key(req, (0, d, req.arrival_time, rid))
        self._seq += 1
        self._flip_seq[rid] = self._seq
        heapq.heappush(self._flips, (d - p - 1e-9 * (abs(d) + abs(p) + 1.0), self._seq, rid))

    def discard(self, request_id: int) -> None:
        if self._reqs.pop(request_id, None) is not None:
            del self._key[request_id]
            del self._class_of[request_id]
            self._p.pop(request_id, None)
            self._flip_seq.pop(request_id, None)
            self._compact()

    def _set_key(self, req: Request, key: PriorityKey) -> None:
        self._key[req.request_id] = key
        entry = (key, req)
        heapq.heappush(self._heap, entry)
        c = self._class_of[req.request_id]
        heap = self._classes.get(c)
        if heap is None:
            self._classes[c] = [entry]
        else:
            heapq.heappush(heap, entry)

    def _compact(self) -> None:
        """Drop dead entries once they outnumber the live ones (amortised O(1) per removal)."""
        live = len(self._reqs)
        if len(self._heap) > 2 * live + 64:
            keys = self._key
            self._heap = [e for e in self._heap if keys.get(e[1].request_id) is e[0]]
            heapq.heapify(self._heap)
            classes: dict[int, list[tuple[PriorityKey, Request]]] = {}
            for e in self._heap:
                classes.setdefault(self._class_of[e[1].request_id], []).append(e)
            for heap in classes.values():
                heapq.heapify(heap)
            self._classes = classes
        if len(self._rem) > 2 * live + 64:
            self._rem = [e for e in self._rem if e[1] in self._reqs]
            heapq.heapify(self._rem)
        if len(self._flips) > 2 * live + 64:
            self._flips = [e for e in self._flips if self._flip_seq.get(e[2]) == e[1]]
            heapq.heapify(self._flips)

    # ---- time ------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Bring every key to ``now``: rebuild after a refit or a step back in time, then move the
        requests whose slack turned negative."""
        if self.ordering not in _FLIPPING:
            return
        version = getattr(self.predict, "version", None)
        if version != self._version or now < self._now:
            self._version = version
            self._rebuild()
        self._now = now
        self._settle(now)

    def _settle(self, now: float) -> None:
        flips, keys, reqs, ps, live = self._flips, self._key, self._reqs, self._p, self._flip_seq
        near = []
        while flips and flips[0][0] <= now:
            entry = heapq.heappop(flips)
            rid = entry[2]
            if live.get(rid) != entry[1]:
                continue                                   # gone, re-added, or already negative
            d = keys[rid][1]
            if d - now - ps[rid] >= 0:                     # the reference's own expression
                near.append(entry)
            else:
                del live[rid]
                req = reqs[rid]
                self._set_key(req, (2, -d, req.arrival_time, rid))
        for entry in near:
            heapq.heappush(flips, entry)
        self._compact()

    def _rebuild(self) -> None:
        members = list(self._reqs.values())
        self._reqs, self._key, self._p, self._class_of, self._classes = {}, {}, {}, {}, {}
        self._heap, self._flips, self._rem, self._flip_seq = [], [], [], {}
        self._now = -INF
        for req in members:
            self.add(req)

    # ---- queries ---------------------------------------------------------------------------
    def top(self) -> tuple[PriorityKey, Request] | None:
        """The best member (call :meth:`advance` first)."""
        heap, keys = self._heap, self._key
        while heap and keys.get(heap[0][1].request_id) is not heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def ordered(self) -> Iterator[tuple[PriorityKey, Request]]:
        """Members best first, lazily (call :meth:`advance` first; removals during the walk are
        fine, additions are not seen)."""
        if self.top() is None:              # pops the dead entries ahead of the best live one
            return
        heap, keys = self._heap, self._key
        frontier = [(heap[0][0], 0)]
        size = len(heap)
        while frontier:
            key, i = heapq.heappop(frontier)
            req = heap[i][1]
            if keys.get(req.request_id) is key:
                yield key, req
            for j in (2 * i + 1, 2 * i + 2):
                if j < size:
                    heapq.heappush(frontier, (heap[j][0], j))

    def ordered_below(self, after: PriorityKey, bound: Callable[[], int]) -> Iterator[Request]:
        """Members ranked after ``after`` whose remaining prompt tokens may be below ``bound()``,
        best first, lazily: ``bound`` is re-read at every step and may only shrink; a size class
        whose every member is at or above it is no longer walked (members of the boundary class
        may still be yielded: the caller checks each). Removals during the walk are fine."""
        keys = self._key
        limit = bound()
        heaps = {}
        for c, h in self._classes.items():
            if c * BUCKET < limit:
                while h and keys.get(h[0][1].request_id) is not h[0][0]:
                    heapq.heappop(h)           # dead entries ahead of the class's best live one
                if h:
                    heaps[c] = h
        frontier = [(h[0][0], c, 0) for c, h in heaps.items()]
        heapq.heapify(frontier)
        pop, push = heapq.heappop, heapq.heappush
        while frontier:
            key, c, i = pop(frontier)
            if c * BUCKET >= limit:
                continue                         # the class cannot fit any more: drop its subtree
            heap = heaps[c]
            req = heap[i][1]
            if key > after and keys.get(req.request_id) is key:
                yield req
                limit = bound()
            size = len(heap)
            for j in (2 * i + 1, 2 * i + 2):
                if j < size:
                    push(frontier, (heap[j][0], c, j))

    def min_remaining(self) -> int | None:
        """The fewest remaining prompt tokens of any member."""
        rem, reqs = self._rem, self._reqs
        while rem:
            n, rid = rem[0]
            req = reqs.get(rid)
            if req is None:
                heapq.heappop(rem)
            elif req.remaining_prefill != n:             # changed while queued: re-file it
                heapq.heapreplace(rem, (req.remaining_prefill, rid))
            else:
                return n
        return None

    def set_predictor(self, predict: Callable[[float], float]) -> None:
        """A new TTFT predictor (bound cost model): every key is rebuilt."""
        self.predict = predict
        self._version = getattr(predict, "version", None)
        self._rebuild()
