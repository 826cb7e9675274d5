"""FlowPrefill's waiting queue in priority order, maintained per event instead of re-sorted per
decision.

A request's key (:func:`~laneserve.policies.prefill.priority.sedf_key`) is static except for the
sign of its slack ``x = deadline − now − p`` (``p`` = TTFT̂ of its step tokens for S-EDF, 0 for
D-EDF). With ``p`` fixed the sign flips once, from + to −, when ``now`` passes ``deadline − p``.
So:

- one sorted set (:class:`~laneserve.core.sorted_keys.SortedKeys`) of keys ``(0, d, arrival, id)``
  (slack ≥ 0), ``(1, 0, arrival, id)`` (no deadline) and ``(2, −d, arrival, id)`` (slack < 0): the
  group number leads, so its order is the full priority order;
- per member with a deadline, one *entry* in a sorted set: a flip check ``(d − p − tol, id)`` while
  its key is positive, an unflip check ``(d − p + tol, id)`` while it is negative (``tol`` covers
  the rounding difference between ``d − p`` and ``(d − now) − p``). :meth:`advance` walks the
  flip checks that are due and re-evaluates the sign with the exact float expression of the
  reference key (a request still non-negative stays and is checked again next time); a flip
  moves one key;
- ``p`` of a request is computed from its step tokens as filed when it enters (they do not change
  while it waits).

**Refits without a rebuild.** An online predictor refits now and then (its ``version`` changes):
every ``p`` changes, so every sign may. Re-predicting the whole queue at once is O(n) work in
one decision, so it is not done. The members are grouped in *generations*, one per fit their
``p`` was computed under; each generation files its entries by the bit length of the step tokens
(a *band*: ``[2^(b−1), 2^b)`` tokens). When the predictor refits, a new generation starts (new
members join it) and, for every older generation and band, the largest rise ``up`` and fall
``down`` of the prediction between the two fits over the band's token range bound how far any
member's flip point ``d − p`` moved. A positive member can only have turned negative if its stored
flip check is within ``up`` of ``now``, a negative member only positive again if its unflip check
is within ``down`` of it: at every :meth:`advance` exactly those are re-predicted (moved to the
current generation, key fixed if its sign changed), and besides them at most
:data:`MIGRATE_BATCH` more, so the old generations drain over the following decisions. The keys
are then exactly those of a full re-prediction at ``now`` — the decisions are unchanged — while
the work of one decision is proportional to the members whose sign can have changed (those the
refit truly moves, plus those of the same band within its bound), not to the queue. Predictors
that change without telling their polynomial (a ``version`` but no ``coefficients()``) still get
the full rebuild. A step back in time (``now`` below the last ``advance``) re-checks the negative
members whose unflip check is at or after ``now`` the same way.

Work proportional to the queue happens only in bulk, in C: when many keys flip at once (more than
``BULK_FLIP`` + 1/64 of the queue, e.g. after a long step, where moving them one by one would
cost more) the sets they are in are filtered and merged with their new keys in one linear pass
each; the same when a refit makes many members of older generations due at once (a whole TTFT
class of a burst near its flip point: they are re-predicted, and every set they leave or join is
rebuilt once); and :meth:`rebuild` (:meth:`set_predictor`, a new predictor) sorts everything
afresh. In the bulk passes the sign tests and checks are evaluated on arrays (numpy float64:
element-wise the same IEEE operations, in the same order, as the reference's float expression,
so the same signs), the predictor is asked once per distinct step-token count (a burst's members
share few), the due checks are found by bisection, and the new keys are sorted by their float
field (the tuple order only where two share it). :attr:`rekeys` counts the members re-predicted,
:attr:`predictions` the predictor's answers the bulk passes asked for, :attr:`moves` the members
moved one key at a time (for tests and benchmarks: at most a bounded number per decision,
whatever the queue).

``ordered`` walks the keys best first; requests may be removed during the walk. EDF and FCFS keys
never change. Every key is also filed in the sorted set of its *size class* (remaining prompt
tokens: 4 tokens wide below 128, 32 below 512, ``BUCKET`` above): :meth:`ordered_below` merges
only the classes that can hold a request shorter than a bound that shrinks as Algorithm 1's batch
grows, so the long prompts ahead of the short ones are not walked one by one when none of them
can fit any more; the narrow short classes keep the boundary class small when the bound gets
down to a few tokens with thousands of short prompts queued.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from operator import itemgetter

import numpy as np

from laneserve.core.request import Request
from laneserve.core.sorted_keys import SortedKeys
from laneserve.policies.prefill.priority import INF, ORDERINGS, PriorityKey

_FLIPPING = ("sedf", "dedf")
BUCKET = 128                 # tokens per size class of :meth:`SignedDeadlineQueue.ordered_below` (long prompts)
MIGRATE_BATCH = 32           # members of older generations re-predicted per advance beyond the due ones
BULK_FLIP = 64               # flips beyond this + 1/64 of the queue go in by one merge per set
_VECTOR = 32                 # members from which a pass over them is done on arrays
_MARGIN = 1e-9               # relative slack of the refit bounds (float evaluation of p and of d - now)

Coefficients = tuple[float, float, float]


def _tol(d: float, p: float) -> float:
    return 1e-9 * (abs(d) + abs(p) + 1.0)


def _band_range(band: int) -> tuple[int, int]:
    """The step-token counts of a band (their bit length is ``band``)."""
    return (0, 0) if band == 0 else (1 << (band - 1), (1 << band) - 1)


def _poly_extremes(a: Coefficients, lo: float, hi: float) -> tuple[float, float]:
    """``(max, min)`` of ``a0 + a1 t + a2 t²`` over ``lo <= t <= hi``."""
    a0, a1, a2 = a
    points = [lo, hi]
    if a2 != 0.0:
        vertex = -a1 / (2.0 * a2)
        if lo < vertex < hi:
            points.append(vertex)
    values = [a0 + t * (a1 + t * a2) for t in points]
    return max(values), min(values)


def refit_bounds(old: Coefficients, new: Coefficients, band: int) -> tuple[float, float]:
    """``(up, down)``: bounds on how much the prediction of a step of ``band``'s token counts can
    rise and fall from the ``old`` fit to the ``new`` one (each ≥ 0, with a margin for the float
    evaluation of the predictions and of the slack test)."""
    lo, hi = _band_range(band)
    diff = (new[0] - old[0], new[1] - old[1], new[2] - old[2])
    top, bottom = _poly_extremes(diff, float(lo), float(hi))
    scale = 1.0 + sum(abs(c) * hi ** k for k, c in enumerate(old)) + sum(abs(c) * hi ** k for k, c in enumerate(new))
    margin = _MARGIN * scale
    return max(top, 0.0) + margin, max(-bottom, 0.0) + margin


def _merged(keys: SortedKeys, changed: dict[int, PriorityKey], first: PriorityKey, last: PriorityKey,
            count: int, runs: Iterable[list[PriorityKey]]) -> SortedKeys:
    """``keys`` without the ``count`` old keys of the members of ``changed`` (all in ``keys``,
    ``first`` the least, ``last`` the greatest; id last in each key), plus the sorted ``runs``.
    When the old keys are one contiguous run of ``keys`` (a deadline class flipping together)
    it is cut out by slicing, else the members of ``changed`` are filtered out."""
    ordered = keys.to_list()
    at = bisect_left(ordered, first)
    end = at + count
    if end <= len(ordered) and ordered[end - 1] == last:         # every old key lies in [at, end)
        kept = ordered[:at] + ordered[end:]
    else:
        kept = [k for k in ordered if k[3] not in changed]
    return _joined(kept, runs)


def _joined(kept: list, runs: Iterable[list]) -> SortedKeys:
    """The sorted set of the sorted list ``kept`` and the sorted ``runs`` (none sharing a key):
    a run is spliced in one piece when it falls between two neighbours of ``kept`` (a deadline
    class flipping together: no comparison but two), else the rest are merged by one sort (a
    linear merge of sorted runs, in C)."""
    rest = []
    for added in runs:
        if not added:
            continue
        at = bisect_left(kept, added[0])
        if at == len(kept) or added[-1] < kept[at]:
            kept = kept[:at] + added + kept[at:]
        else:
            rest.extend(added)
    return SortedKeys(kept + rest) if rest else SortedKeys.from_sorted(kept)


def _split(items: list, labels: list[int]) -> Iterator[tuple[int, list]]:
    """``(label, items with that label)`` per distinct label, each part in the order of
    ``items`` (a stable partition, grouped by one stable sort of the labels)."""
    if not items:
        return
    labels_ = np.array(labels)
    order = np.argsort(labels_, kind="stable")
    grouped = labels_[order]
    cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(items)]):
        yield int(grouped[lo]), [items[i] for i in order[lo:hi].tolist()]


def _sorted_group(keys: list[PriorityKey]) -> list[PriorityKey]:
    """``sorted(keys)`` for keys of one group (first fields equal): sorted by their second field
    (a float: compared without the tuple machinery), then fully only when two share it."""
    keys.sort(key=itemgetter(1))
    if len(set(map(itemgetter(1), keys))) < len(keys):
        keys.sort()
    return keys


def size_class(tokens: int) -> int:
    """The size class of ``tokens`` remaining prompt tokens (classes are ordered like sizes)."""
    if tokens < 128:
        return tokens >> 2
    if tokens < 512:
        return 32 + ((tokens - 128) >> 5)
    return 44 + (tokens - 512) // BUCKET


def class_range(c: int) -> tuple[int, int]:
    """``(lo, hi)``: the class holds the token counts ``lo <= n < hi``."""
    if c < 32:
        return 4 * c, 4 * c + 4
    if c < 44:
        return 128 + 32 * (c - 32), 160 + 32 * (c - 32)
    lo = 512 + BUCKET * (c - 44)
    return lo, lo + BUCKET


def _class_of(req: Request) -> int:
    """The class a member is filed in: its size class, as ``-1 - class`` once its prefill started
    (it holds its KV: admitting it again needs none, so the started are walked apart)."""
    c = size_class(req.remaining_prefill)
    return c if req.times.prefill_start is None else -1 - c


class _Generation:
    """The members whose ``p`` was predicted under one fit: their flip and unflip checks, per band
    of step tokens, and (once a newer fit exists) per band the bounds of the change of ``p``."""

    __slots__ = ("coefficients", "flips", "unflips", "up", "down", "size")

    def __init__(self, coefficients: Coefficients | None) -> None:
        self.coefficients = coefficients
        self.flips: dict[int, SortedKeys] = {}
        self.unflips: dict[int, SortedKeys] = {}
        self.up: dict[int, float] = {}
        self.down: dict[int, float] = {}
        self.size = 0

    def add(self, entry: tuple[float, int], band: int, positive: bool) -> None:
        sets = self.flips if positive else self.unflips
        members = sets.get(band)
        if members is None:
            sets[band] = SortedKeys((entry,))
        else:
            members.add(entry)
        self.size += 1

    def remove(self, entry: tuple[float, int], band: int, positive: bool) -> None:
        sets = self.flips if positive else self.unflips
        members = sets[band]
        members.remove(entry)
        if not members:
            del sets[band]
        self.size -= 1

    def drop(self, band: int, positive: bool, gone: set[int]) -> None:
        """Remove the checks of the members ``gone`` (all in this band and sign) at once."""
        sets = self.flips if positive else self.unflips
        checks, k = sets[band].to_list(), len(gone)
        if all(e[1] in gone for e in checks[:k]):            # the first ones (due flips)
            kept = checks[k:]
        elif all(e[1] in gone for e in checks[len(checks) - k:]):     # the last ones (due unflips)
            kept = checks[:len(checks) - k]
        else:
            kept = [e for e in checks if e[1] not in gone]
        if kept:
            sets[band] = SortedKeys.from_sorted(kept)
        else:
            del sets[band]
        self.size -= len(gone)

    def cut(self, band: int, positive: bool, count: int) -> None:
        """Remove the first ``count`` flip checks (``positive``) or the last ``count`` unflip
        checks of ``band`` at once (the due ones of :meth:`SignedDeadlineQueue._due`)."""
        sets = self.flips if positive else self.unflips
        checks = sets[band].to_list()
        kept = checks[count:] if positive else checks[:len(checks) - count]
        if kept:
            sets[band] = SortedKeys.from_sorted(kept)
        else:
            del sets[band]
        self.size -= count

    def merge(self, band: int, positive: bool, added: list[tuple[float, int]]) -> None:
        """Add the checks ``added`` (of members not in this generation yet) at once."""
        sets = self.flips if positive else self.unflips
        members = sets.get(band)
        sets[band] = _joined(members.to_list() if members else [], (sorted(added),))
        self.size += len(added)

    def bound(self, current: Coefficients) -> None:
        """Bounds of the change of ``p`` from this fit to ``current``, per band."""
        old = self.coefficients
        assert old is not None
        self.up, self.down = {}, {}
        for band in {*self.flips, *self.unflips}:
            self.up[band], self.down[band] = refit_bounds(old, current, band)


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
        self._p: dict[int, float] = {}                 # predicted seconds (flipping, with a deadline)
        self._band: dict[int, int] = {}                # band of the step tokens as filed
        self._tokens: dict[int, int] = {}              # step tokens as filed (S-EDF)
        self._entry: dict[int, tuple[float, int]] = {}  # flip or unflip check (flipping, with a deadline)
        self._gen_of: dict[int, _Generation] = {}
        self._class_of: dict[int, int] = {}            # size class of each member
        self._rem: dict[int, tuple[int, int]] = {}     # (remaining prefill, id) as filed
        self._order = SortedKeys()
        self._classes: dict[int, SortedKeys] = {}      # size class -> its members' keys
        self._by_rem = SortedKeys()
        self._now = -INF
        self._version = getattr(predict, "version", None)
        self._gens: list[_Generation] = [_Generation(self._coefficients())]   # oldest first
        self.rekeys = 0
        self.moves = 0              # members moved one at a time (outside the bulk passes)
        self.predictions = 0        # predictor calls of the bulk re-predictions
        self._pending: dict[int, PriorityKey] = {}     # new keys not in the sorted sets yet (bulk)
        self._was: dict[int, PriorityKey] = {}         # their keys in the sorted sets

    # ---- membership ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._reqs

    def add(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._reqs:
            self.discard(rid)
        if self.ordering in _FLIPPING:
            self._sync()
        self._reqs[rid] = req
        self._class_of[rid] = c = _class_of(req)
        self._rem[rid] = rem = (req.remaining_prefill, rid)
        key = self._file(req)
        self._order.add(key)
        if c in self._classes:
            self._classes[c].add(key)
        else:
            self._classes[c] = SortedKeys((key,))
        self._by_rem.add(rem)

    def _file(self, req: Request) -> PriorityKey:
        """Record ``req``'s key (positive, checked at the next :meth:`advance`) and its flip check
        in the current generation; not the sorted sets of keys."""
        rid = req.request_id
        if self.ordering not in _FLIPPING:
            key = self._key[rid] = ORDERINGS[self.ordering](req, 0.0, 0.0)
            return key
        d = req.ttft_deadline
        if d == INF:
            key = self._key[rid] = (1, 0.0, req.arrival_time, rid)
            return key
        if self.ordering == "sedf":
            tokens = self._tokens[rid] = self.step_tokens(req)
            p = self.predict(tokens)
            band = int(tokens).bit_length()
        else:
            p, band = 0.0, 0
        self._p[rid] = p
        self._band[rid] = band
        key = self._key[rid] = (0, d, req.arrival_time, rid)
        entry = self._entry[rid] = (d - p - _tol(d, p), rid)
        gen = self._gen_of[rid] = self._gens[-1]
        gen.add(entry, band, True)
        return key

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
        entry = self._entry.pop(request_id, None)
        if entry is not None:
            gen = self._gen_of.pop(request_id)
            gen.remove(entry, self._band.pop(request_id), key[0] == 0)
            self._p.pop(request_id)
            self._tokens.pop(request_id, None)
            if gen.size == 0 and gen is not self._gens[-1]:
                self._gens.remove(gen)

    # ---- the predictor's fits --------------------------------------------------------------
    def _coefficients(self) -> Coefficients | None:
        """The polynomial of the current fit, when the predictor tells it (None: unknown)."""
        if self.ordering == "dedf":
            return (0.0, 0.0, 0.0)
        coefficients = getattr(self.predict, "coefficients", None)
        return tuple(coefficients()) if callable(coefficients) else None     # type: ignore[return-value]

    def _sync(self) -> None:
        """Start a generation when the predictor refitted (bounding how far each older one's
        predictions moved), or rebuild when its fit cannot be read."""
        version = getattr(self.predict, "version", None)
        if version == self._version:
            return
        self._version = version
        if self.ordering == "dedf":                      # p is 0 whatever the fit
            return
        current = self._coefficients()
        if current is None or any(g.coefficients is None for g in self._gens if g.size):
            self.rebuild()
            return
        if self._gens[-1].size == 0:
            self._gens.pop()
        for gen in self._gens:
            gen.bound(current)
        self._gens.append(_Generation(current))

    # ---- time ------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Bring every key to ``now``: re-predict the members a refit may have moved (see the
        module docstring) and some more of the older generations, then move the requests whose
        slack turned negative (or, after a step back in time, non-negative again). The bulk
        passes defer the sets of keys to one rebuild at the end."""
        if self.ordering not in _FLIPPING:
            return
        self._sync()
        back = now < self._now
        self._now = now
        if len(self._gens) > 1:
            self._migrate_due(now)
        self._settle(now, back)
        if self._pending:
            self._rekey_bulk(self._pending, self._was)
            self._pending, self._was = {}, {}

    def _migrate_due(self, now: float) -> None:
        """Re-predict every member of an older generation whose sign may have changed (in one
        bulk pass when they are many), then up to :data:`MIGRATE_BATCH` more (oldest generation
        first)."""
        due = self._due(now)
        if sum(len(group[3]) for group in due) > BULK_FLIP + len(self._reqs) // 64:
            self._migrate_bulk(due, now)
        else:
            for group in due:
                for rid in group[3]:
                    self._migrate(rid, now)
        budget = MIGRATE_BATCH
        for gen in self._gens[:-1]:
            for sets, pick in ((gen.flips, SortedKeys.first), (gen.unflips, SortedKeys.last)):
                for members in list(sets.values()):
                    while budget > 0 and members:
                        self._migrate(pick(members)[1], now)
                        budget -= 1
            if budget <= 0:
                break
        self._gens = [g for g in self._gens[:-1] if g.size] + [self._gens[-1]]

    def _due(self, now: float) -> list[tuple[_Generation, int, bool, list[int]]]:
        """The members of older generations whose sign the refits since their fit may have
        changed by ``now`` (flip checks within ``up`` of it, unflip checks within ``down``), per
        generation, band and sign: ``(generation, band, positive, ids)``, the ids those of the
        first checks of the band's flip checks, or of the last of its unflip checks (found by
        bisection)."""
        margin = _MARGIN * (abs(now) + 1.0)
        due = []
        for gen in self._gens[:-1]:
            for band, flips in gen.flips.items():
                limit = now + gen.up[band] + margin
                if flips.first()[0] <= limit:
                    checks = flips.to_list()
                    due.append((gen, band, True, list(map(itemgetter(1), checks[:bisect_right(checks, (limit, INF))]))))
            for band, unflips in gen.unflips.items():
                limit = now - gen.down[band] - margin
                if unflips.last()[0] >= limit:
                    checks = unflips.to_list()
                    due.append((gen, band, False, list(map(itemgetter(1), checks[bisect_left(checks, (limit, -INF)):]))))
        return due

    def _migrate_bulk(self, due: list[tuple[_Generation, int, bool, list[int]]], now: float) -> None:
        """:meth:`_migrate` for every member of ``due`` at once: the same predictions, keys and
        checks (the same float expressions, evaluated element-wise on arrays), but the
        predictor is asked once per step-token count, and each sorted set they leave or join
        is rebuilt once (cut, merged with the new entries) instead of changed one key at a
        time."""
        keys, current = self._key, self._gens[-1]
        joining: dict[tuple[int, bool], list[tuple[float, int]]] = {}
        changed, was = self._pending, self._was
        for gen, band, positive, rids in due:
            n = len(rids)
            ps = self._predicted(map(self._tokens.__getitem__, rids)) if self.ordering == "sedf" else [0.0] * n
            old = list(map(keys.__getitem__, rids))
            d = np.fromiter(map(itemgetter(1), old), float, n)
            if not positive:
                d = -d
            p = np.array(ps, dtype=float)
            negative = d - now - p < 0
            tol = 1e-9 * (np.abs(d) + np.abs(p) + 1.0)                # _tol
            base = d - p
            checks = list(zip(np.where(negative, base + tol, base - tol).tolist(), rids))
            self._p.update(zip(rids, ps))
            self._entry.update(zip(rids, checks))
            self._gen_of.update(dict.fromkeys(rids, current))
            turned = np.flatnonzero(negative if positive else ~negative).tolist()
            if turned:
                trids = [rids[i] for i in turned]
                tkeys = [was.get(rid, old[i]) for i, rid in zip(turned, trids)] if was else [old[i] for i in turned]
                if positive:
                    new = list(zip(repeat(2), (-d[turned]).tolist(), map(itemgetter(2), tkeys), trids))
                else:
                    new = list(zip(repeat(0), d[turned].tolist(), map(itemgetter(2), tkeys), trids))
                keys.update(zip(trids, new))
                changed.update(zip(trids, new))
                was.update(zip(trids, tkeys))
            gen.cut(band, positive, n)
            for sign_now, members in ((True, ~negative), (False, negative)):
                added = [checks[i] for i in np.flatnonzero(members).tolist()]
                if added:
                    joining.setdefault((band, sign_now), []).extend(added)
            self.rekeys += n
        for (band, positive), added in joining.items():
            current.merge(band, positive, added)

    def _predicted(self, counts: Iterable[int]) -> list[float]:
        """The current fit's ``p`` of each step-token count of ``counts``, the predictor asked
        once per distinct count (:attr:`predictions` counts the asks)."""
        counts = list(counts)
        memo = {}
        for n in set(counts):
            memo[n] = self.predict(n)
        self.predictions += len(memo)
        return list(map(memo.__getitem__, counts))

    def _migrate(self, rid: int, now: float) -> None:
        """Re-predict member ``rid`` of an older generation under the current fit and file it in
        the current generation, its key fixed if the sign changed."""
        key, band, entry = self._key[rid], self._band[rid], self._entry[rid]
        positive = key[0] == 0
        self._gen_of[rid].remove(entry, band, positive)
        d = key[1] if positive else -key[1]
        p = self._p[rid] = self.predict(self._tokens[rid]) if self.ordering == "sedf" else 0.0
        self.rekeys += 1
        self.moves += 1
        negative = d - now - p < 0
        if negative == positive:                          # the sign changed
            new = (2, -d, key[2], rid) if negative else (0, d, key[2], rid)
            self._move(rid, key, new)
        self._file_entry(rid, d, p, band, not negative)

    def _file_entry(self, rid: int, d: float, p: float, band: int, positive: bool) -> None:
        entry = self._entry[rid] = (d - p - _tol(d, p), rid) if positive else (d - p + _tol(d, p), rid)
        gen = self._gen_of[rid] = self._gens[-1]
        gen.add(entry, band, positive)

    def _move(self, rid: int, old: PriorityKey, new: PriorityKey) -> None:
        """Replace ``rid``'s key in the sorted sets of keys."""
        self._key[rid] = new
        if self._pending:                # a bulk pass is under way: its rebuild takes this one too
            self._pending[rid] = new
            self._was.setdefault(rid, old)
            return
        self._order.remove(old)
        self._order.add(new)
        members = self._classes[self._class_of[rid]]
        members.remove(old)
        members.add(new)

    def _settle(self, now: float, back: bool) -> None:
        keys, ps = self._key, self._p
        gen = self._gens[-1]
        by_band: dict[int, list[int]] = {}
        for band, flips in gen.flips.items():
            if flips.first()[0] > now:
                continue
            checks = flips.to_list()
            rids = list(map(itemgetter(1), checks[:bisect_right(checks, (now, INF))]))
            if len(rids) < _VECTOR:
                flipping = [rid for rid in rids if keys[rid][1] - now - ps[rid] < 0]   # the reference's expression
            else:                                         # the same, element-wise on arrays
                d = np.fromiter(map(itemgetter(1), map(keys.__getitem__, rids)), float, len(rids))
                p = np.fromiter(map(ps.__getitem__, rids), float, len(rids))
                flipping = [rids[i] for i in np.flatnonzero(d - now - p < 0).tolist()]
            if flipping:
                by_band[band] = flipping
        if back:
            self._unflip_back(now)
        if not by_band:
            return
        count = sum(map(len, by_band.values()))
        if count > BULK_FLIP + len(self._reqs) // 64:        # a burst: merge them in at once
            self._flip_bulk(by_band)
            return
        bands = self._band
        self.moves += count
        for rid in (rid for flipping in by_band.values() for rid in flipping):
            old = keys[rid]
            gen.remove(self._entry[rid], bands[rid], True)
            d = old[1]
            self._move(rid, old, (2, -d, old[2], rid))
            self._file_entry(rid, d, ps[rid], bands[rid], False)

    def _unflip_back(self, now: float) -> None:
        """After a step back in time: the current generation's negative members whose slack is
        non-negative again at ``now`` turn positive."""
        gen, keys, ps = self._gens[-1], self._key, self._p
        limit = now - _MARGIN * (abs(now) + 1.0)
        turning = []
        for unflips in gen.unflips.values():
            for check in reversed(unflips):
                if check[0] < limit:
                    break
                rid = check[1]
                if not -keys[rid][1] - now - ps[rid] < 0:
                    turning.append(rid)
        self.moves += len(turning)
        for rid in turning:
            old, band = keys[rid], self._band[rid]
            gen.remove(self._entry[rid], band, False)
            d = -old[1]
            self._move(rid, old, (0, d, old[2], rid))
            self._file_entry(rid, d, ps[rid], band, True)

    def _flip_bulk(self, by_band: dict[int, list[int]]) -> None:
        """Turn the keys of the members ``by_band`` (current generation, positive, per band)
        negative and rebuild the sets they are in: each is the set without them merged with
        their new keys (at the end of :meth:`advance` for the sets of keys), not changed one key
        at a time. Their unflip checks are computed on arrays (the same float expression)."""
        gen, keys, ps, was = self._gens[-1], self._key, self._p, self._was
        for band, flipping in by_band.items():
            n = len(flipping)
            old = list(map(keys.__getitem__, flipping))
            d = np.fromiter(map(itemgetter(1), old), float, n)
            p = np.fromiter(map(ps.__getitem__, flipping), float, n)
            new = list(zip(repeat(2), (-d).tolist(), map(itemgetter(2), old), flipping))
            keys.update(zip(flipping, new))
            self._pending.update(zip(flipping, new))
            was.update(zip(flipping, [was.get(rid, key) for rid, key in zip(flipping, old)] if was else old))
            checks = list(zip((d - p + 1e-9 * (np.abs(d) + np.abs(p) + 1.0)).tolist(), flipping))   # _tol
            self._entry.update(zip(flipping, checks))
            gen.drop(band, True, set(flipping))
            gen.merge(band, False, checks)

    def _rekey_bulk(self, changed: dict[int, PriorityKey], was: dict[int, PriorityKey]) -> None:
        """Give each member of ``changed`` its new key in the sets of keys (``was``: its key
        there now): every set holding one of them is rebuilt once, the others kept in order
        plus the new keys sorted (a linear merge in C). The new keys are sorted once per group
        (:func:`_sorted_group`); split by size class they stay sorted."""
        class_of = self._class_of
        news = changed.values()
        runs = [_sorted_group([k for k in news if k[0] == group]) for group in (0, 2)]
        olds = was.values()
        self._order = _merged(self._order, changed, min(olds), max(olds), len(was), runs)
        by_class: dict[int, list[list[PriorityKey]]] = {}
        for run in runs:
            for c, keys in _split(run, list(map(class_of.__getitem__, map(itemgetter(3), run)))):
                by_class.setdefault(c, []).append(keys)
        for c, parts in by_class.items():
            kept = [k for k in self._classes[c].to_list() if k[3] not in changed]
            self._classes[c] = _joined(kept, parts)

    def rebuild(self) -> None:
        """Re-predict every member and re-sort every structure (O(n log n), one C sort each): for
        a new predictor; keys are positive again until the next :meth:`advance`."""
        members = list(self._reqs.values())
        self._reqs, self._key, self._p, self._class_of, self._rem = {}, {}, {}, {}, {}
        self._band, self._tokens, self._entry, self._gen_of = {}, {}, {}, {}
        self._gens = [_Generation(self._coefficients())]
        self._now = -INF
        self._pending, self._was = {}, {}
        for req in members:
            rid = req.request_id
            self._reqs[rid] = req
            self._class_of[rid] = _class_of(req)
            self._rem[rid] = (req.remaining_prefill, rid)
            self._file(req)
            self.rekeys += 1
        self._index()
        self._by_rem = SortedKeys(self._rem.values())

    def _index(self) -> None:
        """Sort the sets of keys afresh from the per-member records."""
        self._order = SortedKeys(self._key.values())
        by_class: dict[int, list[PriorityKey]] = {}
        class_of = self._class_of
        for rid, key in self._key.items():
            by_class.setdefault(class_of[rid], []).append(key)
        self._classes = {c: SortedKeys(ks) for c, ks in by_class.items()}

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

    def ordered_below(self, after: PriorityKey, bound: Callable[[], int], floor: int = 0,
                      fresh_bound: Callable[[], float] | None = None) -> Iterator[Request]:
        """Members ranked after ``after`` whose remaining prompt tokens may be below ``bound()``
        (and, with ``floor``, may be at least ``floor``; with ``fresh_bound``, below
        ``fresh_bound()`` too for those not started), best first, lazily: the bounds are re-read
        at every step and may only shrink; a size class whose every member is at or above them
        (or below ``floor``) is not walked (members of the boundary classes may still be
        yielded: the caller checks each). Removals during the walk are fine."""
        reqs = self._reqs
        for key in self._merge_classes(after, bound, floor, fresh_bound):
            yield reqs[key[3]]

    def ordered_admissible(self, after: PriorityKey, fresh_bound: Callable[[], float]
                           ) -> Iterator[tuple[PriorityKey, Request]]:
        """Members ranked after ``after``, best first, lazily, leaving out those not started
        whose remaining prompt tokens are at or above ``fresh_bound()`` (re-read at every step,
        may only shrink): after a prompt of that many tokens found no KV memory, none of them
        can be admitted, while the started hold theirs. Removals during the walk are fine."""
        reqs = self._reqs
        for key in self._merge_classes(after, lambda: INF, 0, fresh_bound):
            yield key, reqs[key[3]]

    def _merge_classes(self, after: PriorityKey | None, bound: Callable[[], float], floor: int,
                       fresh_bound: Callable[[], float] | None) -> Iterator[PriorityKey]:
        """The keys after ``after`` of the classes that may hold a member under the bounds, in
        order (a heap merge of the classes' walks)."""
        limit = bound()
        fresh = limit if fresh_bound is None else min(limit, fresh_bound())
        walks = {}
        for c, members in self._classes.items():
            lo, hi = class_range(c if c >= 0 else -1 - c)
            if lo < (fresh if c >= 0 else limit) and hi > floor:
                walks[c] = lo, members.walk(after)
        frontier = []
        for c, (lo, walk) in walks.items():
            key = next(walk, None)
            if key is not None:
                frontier.append((key, c, lo))
        heapq.heapify(frontier)
        while frontier:
            key, c, lo = frontier[0]
            if lo >= (fresh if c >= 0 else limit):
                heapq.heappop(frontier)          # the class cannot fit any more: drop it
                continue
            yield key
            limit = bound()
            fresh = limit if fresh_bound is None else min(limit, fresh_bound())
            key = next(walks[c][1], None)
            if key is None:
                heapq.heappop(frontier)
            else:
                heapq.heapreplace(frontier, (key, c, lo))

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
