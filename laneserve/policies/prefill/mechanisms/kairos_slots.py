"""Kairos prefill's queue as numpy columns in arrival order.

Algorithm 2's FCFS walk is a prefix sum: with every queued request already arrived (``arrival <=
now``) the cursor never jumps, so request ``k`` finishes at ``now + Σ_{j<=k} n_j / μ``. The columns
(remaining tokens, arrival, SLO, prompt length, optional cost-model durations) are kept per event:
an arrival appends a slot, a finished prompt empties its slot (0 tokens add exactly ``+0.0`` to the
running sum, so the sums equal the Python walk's bit for bit), a partial chunk rewrites its slot.
Emptied slots are compacted away once they outnumber the live ones. A decision is then a handful of
vectorised passes (``np.cumsum`` accumulates left to right, as the walk does) and a partial sort of
the best scores, instead of a Python loop and a full sort.

When an online predictor refits, every slot's cost-model duration changes. :func:`linear_prefill_times`
recomputes the column in a few vectorised passes, bit for bit what the model's own ``prefill_time``
returns per request (a linear model evaluates ``np.dot`` of its coefficients and the features,
which on the BLAS builds we run is a chain of fused multiply-adds; the chain is emulated exactly
with error-free transformations, and the rare element whose emulation cannot be proved exact is
computed with rationals). Each use checks a few rows against the model's own evaluation and falls
back to it for every row on a mismatch, so a BLAS that sums differently costs time, never a
different decision.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

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
        self.deadline = np.full(capacity, INF)       # the TTFT deadline each request carries
        self.plen = np.ones(capacity)
        self.has_slo = np.zeros(capacity, dtype=bool)
        self.alive = np.zeros(capacity, dtype=bool)
        self.rid = np.zeros(capacity, dtype=np.int64)
        self.fresh = np.zeros(capacity, dtype=bool)  # not started, no KV blocks: a KV refusal's bound applies

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.rem, self.dur, self.arr, self.slo, self.deadline, self.plen, self.has_slo, self.alive,
                self.rid, self.fresh)

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
        self.deadline[i] = req.ttft_deadline
        self.alive[i] = True
        self.rid[i] = req.request_id
        self.rem[i] = req.remaining_prefill
        self.dur[i] = 0.0
        self.fresh[i] = False          # the policy says which are (set_fresh): it knows the KV tables
        if req.arrival_time > self.max_arrival:
            self.max_arrival = req.arrival_time

    def set_work(self, req: Request, tokens: int, duration: float) -> None:
        """``req``'s work as its policy estimates it: tokens to compute, and seconds (cost estimate)."""
        i = self.slot.get(req.request_id)
        if i is not None:
            self.rem[i] = tokens
            self.dur[i] = duration

    def set_fresh(self, req: Request, fresh: bool) -> None:
        """Whether ``req`` has not started and holds no KV blocks (a length bound from a KV
        refusal then covers it: :func:`~laneserve.policies.prefill.kairos.best_first`'s ``skip``)."""
        i = self.slot.get(req.request_id)
        if i is not None:
            self.fresh[i] = fresh

    def drop(self, req: Request) -> None:
        i = self.slot.pop(req.request_id, None)
        if i is None:
            return
        self.reqs[i] = None
        self.rem[i] = self.dur[i] = 0.0
        self.alive[i] = self.fresh[i] = False
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


# ---- the cost-model durations of every slot at once ---------------------------------------------
_SPLIT = 134217729.0          # 2^27 + 1 (Veltkamp)
_CHECK_ROWS = 8


def _exact_fma(a: float, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``round(a * b + c)`` element-wise with a single rounding (what a fused multiply-add
    returns), for finite values far from overflow and underflow."""
    p = a * b
    t = _SPLIT * a
    ah = t - (t - a)
    al = a - ah
    t = _SPLIT * b
    bh = t - (t - b)
    bl = b - bh
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl          # a*b = p + e exactly
    s = p + c
    z = s - p
    t1 = (p - (s - z)) + (c - z)                                # p + c = s + t1 exactly
    v = t1 + e
    z = v - t1
    w = (t1 - (v - z)) + (e - z)                                # t1 + e = v + w exactly
    out = s + v
    z = out - s
    d = (s - (out - z)) + (v - z)                               # s + v = out + d exactly
    # a*b + c = out + d + w: out is its rounding unless d + w reaches half the gap to a neighbour
    gap = np.minimum(np.nextafter(out, np.inf) - out, out - np.nextafter(out, -np.inf))
    near = (np.abs(d) + np.abs(w)) * (1.0 + 2.0 ** -50) >= 0.5 * gap
    hard = np.flatnonzero(near & (w != 0.0))                    # rare: decide with rationals
    for i in hard.tolist():
        out[i] = float(Fraction(a) * Fraction(float(b[i])) + Fraction(float(c[i])))
    return out


def _attention(new: np.ndarray, plen: np.ndarray, attention: str) -> np.ndarray:
    """The query-key pair feature of :func:`laneserve.costmodel.fitted.prefill_features` for one
    chunk of ``new`` tokens after ``plen - new`` cached ones, per element, with the same float
    operations (0 where nothing is new)."""
    if attention == "padded":
        attn = new * (plen - new / 2)
    else:
        attn = new * ((plen - new) + new / 2)
    return np.where(new > 0, attn, 0.0)


def linear_prefill_times(model: Any, new: np.ndarray, plen: np.ndarray) -> np.ndarray | None:
    """``model.prefill_time([(n, p - n)])`` for every pair of ``new`` and ``plen`` (float arrays of
    integers), vectorised; None when ``model`` is not a linear step model (no ``prefill_coef``) or
    when the check rows disagree with the model's own evaluation."""
    coef = getattr(model, "prefill_coef", None)
    attention = getattr(model, "attention", None)
    if coef is None or attention is None or len(coef) != 4:
        return None
    c0, c1, c2, c3 = (float(c) for c in coef)
    # np.dot of (tokens, pairs, chunks, 1): fma(c3, 1, fma(c2, chunks, fma(c1, pairs, c0 * tokens))).
    # The chunk count is 0 or 1 and the last feature 1, so those products are exact and their
    # fused multiply-adds are plain additions.
    started = new > 0
    acc = _exact_fma(c1, _attention(new, plen, attention), c0 * new)
    acc = acc + np.where(started, c2, 0.0)
    acc = acc + c3
    out = np.where(started, acc, 0.0)
    step = max(1, len(new) // _CHECK_ROWS)
    for i in range(0, len(new), step):
        n = int(new[i])
        if model.prefill_time([(n, int(plen[i]) - n)]) != out[i]:
            return None
    return out
