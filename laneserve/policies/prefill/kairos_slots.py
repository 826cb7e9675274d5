"""Kairos prefill's queue as numpy columns in arrival order (issue 12, item 1).

Algorithm 2's FCFS walk is a prefix sum: with every queued request already arrived (``arrival <=
now``) the cursor never jumps, so request ``k`` finishes at ``now + Σ_{j<=k} n_j / μ``. The columns
(remaining tokens, arrival, SLO, prompt length, optional cost-model durations) are kept per event:
an arrival appends a slot, a finished prompt empties its slot (0 tokens add exactly ``+0.0`` to the
running sum, so the sums equal the Python walk's bit for bit), a partial chunk rewrites its slot.
Emptied slots are compacted away once they outnumber the live ones. A decision is then a handful of
vectorised passes (``np.cumsum`` accumulates left to right, as the walk does) and a partial sort of
the best scores, instead of a Python loop and a full sort.
"""

from __future__ import annotations

import numpy as np

from laneserve.core.request import Request

INF = float("inf")


class ArrivalSlots:
    def __init__(self, capacity: int = 1024) -> None:
        self.n = 0                                   # slots used (live and emptied)
        self.live = 0
        self.reqs: list[Request | None] = []
        self.slot: dict[int, int] = {}               # request id -> slot
        self.max_arrival = -INF
        self._last: tuple[float, int] = (-INF, -1)   # (arrival, id) of the last slot appended
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.rem = np.zeros(capacity)
        self.dur = np.zeros(capacity)
        self.arr = np.zeros(capacity)
        self.slo = np.ones(capacity)
        self.plen = np.ones(capacity)
        self.has_slo = np.zeros(capacity, dtype=bool)
        self.alive = np.zeros(capacity, dtype=bool)
        self.rid = np.zeros(capacity, dtype=np.int64)

    def _columns(self) -> tuple[np.ndarray, ...]:
        return self.rem, self.dur, self.arr, self.slo, self.plen, self.has_slo, self.alive, self.rid

    def _resize(self, capacity: int, keep: np.ndarray | None = None) -> None:
        old = self._columns()
        n = self.n
        self._alloc(capacity)
        for new, col in zip(self._columns(), old):
            part = col[:n] if keep is None else col[:n][keep]
            new[:len(part)] = part

    def fits_after(self, req: Request) -> bool:
        """True when ``req`` sorts after every slot (arrival order is kept by appending)."""
        return self._last < (req.arrival_time, req.request_id)

    def append(self, req: Request) -> None:
        if self.n == len(self.rem):
            self._resize(2 * len(self.rem))
        i = self.n
        self.n += 1
        self.reqs.append(req)
        self._file(i, req)
        self._last = (req.arrival_time, req.request_id)

    def insert(self, req: Request) -> None:
        """File ``req`` at its place in arrival order (it arrived out of order): the slots after
        it move up one (a late arrival lands near the end, so few slots move)."""
        n = self.n
        if n == len(self.rem):
            self._resize(2 * len(self.rem))
        t, rid = req.arrival_time, req.request_id
        i = int(np.searchsorted(self.arr[:n], t, side="left"))   # emptied slots keep their arrival
        while i < n and self.arr[i] == t and self.rid[i] < rid:
            i += 1
        for col in self._columns():
            col[i + 1:n + 1] = col[i:n].copy()
        self.reqs.insert(i, req)
        self.n = n + 1
        for j in range(i + 1, n + 1):
            moved = self.reqs[j]
            if moved is not None:
                self.slot[moved.request_id] = j
        self._file(i, req)

    def _file(self, i: int, req: Request) -> None:
        self.live += 1
        self.slot[req.request_id] = i
        slo = req.slo.ttft
        self.arr[i] = req.arrival_time
        self.plen[i] = req.prompt_len
        self.has_slo[i] = slo is not None and slo != INF
        self.slo[i] = slo if self.has_slo[i] else 1.0
        self.alive[i] = True
        self.rid[i] = req.request_id
        self.rem[i] = req.remaining_prefill
        self.dur[i] = 0.0
        if req.arrival_time > self.max_arrival:
            self.max_arrival = req.arrival_time

    def set_work(self, req: Request, tokens: int, duration: float) -> None:
        """``req``'s work as its policy estimates it: tokens to compute, and seconds (cost estimate)."""
        i = self.slot.get(req.request_id)
        if i is not None:
            self.rem[i] = tokens
            self.dur[i] = duration

    def drop(self, req: Request) -> None:
        i = self.slot.pop(req.request_id, None)
        if i is None:
            return
        self.reqs[i] = None
        self.rem[i] = self.dur[i] = 0.0
        self.alive[i] = False
        self.live -= 1
        if self.n - self.live > self.live + 64:
            self._compact()

    def _compact(self) -> None:
        keep = self.alive[:self.n].copy()
        reqs = [r for r in self.reqs if r is not None]
        self._resize(max(1024, 2 * len(reqs)), keep)
        self.n = self.live = len(reqs)
        self.reqs = reqs
        self.slot = {r.request_id: i for i, r in enumerate(reqs)}
