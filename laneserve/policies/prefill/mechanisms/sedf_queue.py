"""FlowPrefill's waiting queue in priority order, maintained per event instead of re-sorted per
decision.

A request's key (:func:`~laneserve.policies.prefill.mechanisms.priority.sedf_key`) is static except
for the sign of its slack ``x = deadline − now − p`` (``p`` = TTFT̂ of its step tokens for S-EDF, 0
for D-EDF): ``(0, d, arrival, id)`` while ``x ≥ 0``, ``(2, −d, arrival, id)`` once it is negative,
``(1, 0, arrival, id)`` without a deadline. No key is stored per member; the sign is read off a
*group*'s split point:

- **Groups.** The members with a deadline are grouped by (size class, step-token count): one
  group shares one prediction ``p`` (the step tokens are filed when a request enters and do not
  change while it waits). A group keeps its members sorted by ``(d, arrival, id)``. For fixed
  ``now`` and ``p`` the reference's sign test ``d − now − p < 0`` is monotone in ``d`` (a float
  subtraction never decreases when its first operand grows), so the negative members are a prefix:
  the group stores only the first positive member (``split``), found by bisection with the
  reference's own float expression. A whole TTFT class going late together moves each group's
  split once — O(groups · log members), whatever the number of members that flip.
- **The order** is a lazy merge of the groups' two *parts* — the positive part walked forward
  (``d`` ascending), the negative part backward (``d`` descending; members sharing ``d`` by
  ``(arrival, id)``) — and the members without a deadline (a sorted set per size class, as every
  member of the orderings whose keys never change: EDF, FCFS). Per size class a sorted set holds
  its parts' first keys (``heads``), and one sorted set the least key of every class, so
  :meth:`top` is one lookup and a walk merges the classes, building a class's merge of its parts
  only when it reaches the class.
- **Flip checks.** Per group one flip check ``(d_split − p − tol, group)`` (its first positive
  member's flip point) and one unflip check ``(d_last − p + tol, group)`` (its last negative
  member's); ``tol`` covers the rounding difference between ``d − p`` and ``(d − now) − p``.
  :meth:`advance` re-bisects the groups whose flip check is due (and, after a step back in time,
  those whose unflip check is); a group still non-negative stays and is checked again next time.

**Refits without a rebuild.** An online predictor refits now and then (its ``version`` changes):
every group's ``p`` changes, so every split may. The groups are filed in *generations*, one per
fit their ``p`` was computed under; each generation files its groups' checks by the bit length of
the step tokens (a *band*: ``[2^(b−1), 2^b)`` tokens). When the predictor refits, a new generation
starts and, for every older generation and band, the largest rise ``up`` and fall ``down`` of the
prediction between the two fits over the band's token range bound how far any flip point ``d − p``
moved. A group's split can only have moved if its flip check is within ``up`` of ``now`` or its
unflip check within ``down`` of it (the split members are the ones nearest to changing sign): at
every :meth:`advance` exactly those groups are re-predicted and re-bisected (moved to the current
generation) and besides them at most :data:`MIGRATE_BATCH` more, so the old generations drain over
the following decisions. The signs are then exactly those of a full re-prediction at ``now`` —
the decisions are unchanged — while one decision's work is proportional to the groups whose split
can have moved. Predictors that change without telling their polynomial (a ``version`` but no
``coefficients()``) get a full rebuild. A member added to a group of an older generation
re-predicts that group first.

Counters (for tests and benchmarks): :attr:`rekeys` the groups re-predicted, :attr:`searches`
the split searches, :attr:`predictions` the predictor's answers. None grows with the members
that change sign.

``ordered`` walks the keys best first; requests may be removed during the walk. Every group and
every member without a deadline also belongs to a *size class* (remaining prompt tokens: 4 tokens
wide below 128, 32 below 512, ``BUCKET`` above; the started apart, as they hold their KV):
:meth:`ordered_below` merges only the parts of the classes that can hold a request shorter than a
bound that shrinks as Algorithm 1's batch grows, so the long prompts ahead of the short ones are
not walked one by one when none of them can fit any more.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from itertools import count
from operator import itemgetter

from laneserve.core.request import Request
from laneserve.core.sorted_keys import SortedKeys
from laneserve.policies.prefill.mechanisms.priority import INF, ORDERINGS, PriorityKey

_FLIPPING = ("sedf", "dedf")
BUCKET = 128                 # tokens per size class of :meth:`SignedDeadlineQueue.ordered_below` (long prompts)
MIGRATE_BATCH = 32           # groups of older generations re-predicted per advance beyond the due ones
BULK_SEARCH = 64             # searches in one advance from which their heads and checks are filed at once
_MARGIN = 1e-9               # relative slack of the refit bounds (float evaluation of p and of d - now)

Coefficients = tuple[float, float, float]
Member = tuple[float, float, int]                  # (deadline, arrival, id)
_first = itemgetter(0)


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


_RANGES: dict[int, tuple[int, int]] = {}


def _filed_range(c: int) -> tuple[int, int]:
    """:func:`class_range` of a filed class (``-1 - class`` once started), memoised."""
    bounds = _RANGES.get(c)
    if bounds is None:
        bounds = _RANGES[c] = class_range(c if c >= 0 else -1 - c)
    return bounds


def _class_of(req: Request) -> int:
    """The class a member is filed in: its size class, as ``-1 - class`` once its prefill started
    (it holds its KV: admitting it again needs none, so the started are walked apart)."""
    c = size_class(req.remaining_prefill)
    return c if req.times.prefill_start is None else -1 - c


def _replace(sets: dict, name: Any, gone: set, added: list, key: Callable | None = None) -> None:
    """Rebuild the sorted set ``sets[name]`` (possibly absent) at once: its entries whose sort key
    (``key`` of the entry, or the entry) is not in ``gone``, merged with ``added`` (sorted here;
    a merge of two sorted runs, in C); the set is dropped when nothing is left."""
    old = sets.get(name)
    entries = old.to_list() if old else []
    kept = [e for e, k in zip(entries, entries if key is None else map(key, entries)) if k not in gone]
    added.sort(key=key)
    merged = sorted(kept + added, key=key) if added else kept
    if merged:
        sets[name] = SortedKeys.from_sorted(merged)
    elif old is not None:
        del sets[name]


class _Generation:
    """The groups whose ``p`` was predicted under one fit: their flip and unflip checks, per band
    of step tokens, and (once a newer fit exists) per band the bounds of the change of ``p``."""

    __slots__ = ("coefficients", "flips", "unflips", "up", "down", "size")

    def __init__(self, coefficients: Coefficients | None) -> None:
        self.coefficients = coefficients
        self.flips: dict[int, SortedKeys] = {}
        self.unflips: dict[int, SortedKeys] = {}
        self.up: dict[int, float] = {}
        self.down: dict[int, float] = {}
        self.size = 0

    def add(self, entry: tuple[float, int], band: int, flip: bool) -> None:
        sets = self.flips if flip else self.unflips
        checks = sets.get(band)
        if checks is None:
            sets[band] = SortedKeys((entry,))
        else:
            checks.add(entry)
        self.size += 1

    def remove(self, entry: tuple[float, int], band: int, flip: bool) -> None:
        sets = self.flips if flip else self.unflips
        checks = sets[band]
        checks.remove(entry)
        if not checks:
            del sets[band]
        self.size -= 1

    def bound(self, current: Coefficients) -> None:
        """Bounds of the change of ``p`` from this fit to ``current``, per band."""
        old = self.coefficients
        assert old is not None
        self.up, self.down = {}, {}
        for band in {*self.flips, *self.unflips}:
            self.up[band], self.down[band] = refit_bounds(old, current, band)


class _Group:
    """The members with a deadline of one size class and one step-token count (one prediction
    ``p``), sorted by ``(d, arrival, id)``; those before ``split`` (the first member whose slack is
    non-negative; None: none is) are negative."""

    __slots__ = ("gid", "cls", "lo", "hi", "tokens", "band", "members", "split", "p", "gen", "flip", "unflip",
                 "heads", "touched")

    def __init__(self, gid: int, cls: int, tokens: int, p: float, gen: _Generation) -> None:
        self.gid, self.cls, self.tokens, self.p, self.gen = gid, cls, tokens, p, gen
        self.lo, self.hi = _filed_range(cls)
        self.band = int(tokens).bit_length()
        self.members = SortedKeys()
        self.split: Member | None = None
        self.flip: tuple[float, int] | None = None          # filed checks (in ``gen``)
        self.unflip: tuple[float, int] | None = None
        self.heads: tuple[PriorityKey | None, PriorityKey | None] = (None, None)   # as filed in the heads
        self.touched = True         # members or p changed since the last search (heads and checks to re-file)

    def find_split(self, now: float) -> Member | None:
        """The first member whose slack at ``now`` is non-negative (the reference's expression),
        by bisection (a group of one member is tested directly)."""
        p, members = self.p, self.members
        if len(members) == 1:
            only = members.first()
            return None if only[0] - now - p < 0 else only
        return members.partition(lambda m: m[0] - now - p < 0)

    def boundaries(self) -> tuple[tuple[PriorityKey | None, PriorityKey | None],
                                  tuple[tuple[float, int] | None, tuple[float, int] | None]]:
        """For the current split: the first keys of the two parts (positive, negative: the
        latest negative deadline, of those sharing it the least ``(arrival, id)``) and the flip
        and unflip checks (of the split member and of the last negative member)."""
        members, split, p, gid = self.members, self.split, self.p, self.gid
        last = members.last() if split is None else members.before(split)
        head = None if last is None else members.after((last[0], -INF, -INF))
        heads = (None if split is None else (0, *split), None if head is None else (2, -head[0], head[1], head[2]))
        checks = (None if split is None else (split[0] - p - _tol(split[0], p), gid),
                  None if last is None else (last[0] - p + _tol(last[0], p), gid))
        return heads, checks

    def _negative_after(self, d: float, rest: tuple[float, int]) -> Member | None:
        """The first negative member ranked after the (possibly absent) negative member
        ``(d, *rest)``: the next of its deadline, else the first of the next lower deadline."""
        members, split = self.members, self.split
        nxt = members.after((d, *rest))
        if nxt is not None and nxt[0] == d and (split is None or nxt < split):
            return nxt
        limit = (d, -INF, -INF)
        if split is not None and split < limit:
            limit = split
        prev = members.before(limit)
        return None if prev is None else members.after((prev[0], -INF, -INF))

    def next_after(self, key: PriorityKey) -> PriorityKey | None:
        """The key after ``key`` (one of this group's, maybe removed since) in its part."""
        if key[0] == 0:
            nxt = self.members.after(key[1:])
            return None if nxt is None else (0, *nxt)
        nxt = self._negative_after(-key[1], key[2:])
        return None if nxt is None else (2, -nxt[0], nxt[1], nxt[2])

    after = next_after             # a part's next key, as :meth:`SortedKeys.after` for the other parts

    def first_after(self, positive: bool, key: PriorityKey) -> PriorityKey | None:
        """The first key greater than ``key`` (any key) of this group's positive or negative part."""
        if positive:
            split = self.split
            if split is None or key[0] > 0:
                return None
            if key[0] < 0 or split > key[1:]:
                return (0, *split)
            nxt = self.members.after(key[1:])
            return None if nxt is None else (0, *nxt)
        if key[0] > 2:
            return None
        if key[0] < 2:
            return self.heads[1]
        nxt = self._negative_after(-key[1], key[2:])
        return None if nxt is None else (2, -nxt[0], nxt[1], nxt[2])


class SignedDeadlineQueue:
    def __init__(self, ordering: str, predict: Callable[[float], float],
                 step_tokens: Callable[[Request], int]) -> None:
        if ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {ordering!r}")
        self.ordering = ordering
        self.predict = predict
        self.step_tokens = step_tokens
        self._version = getattr(predict, "version", None)
        self.rekeys = 0             # groups re-predicted
        self.searches = 0           # split searches (bisections of a group)
        self.predictions = 0        # predictor calls
        self._reset()

    def _reset(self) -> None:
        self._reqs: dict[int, Request] = {}
        self._owner: dict[int, _Group | SortedKeys] = {}   # the part holding each member: its group or static class
        self._member: dict[int, Member] = {}           # its (d, arrival, id)
        self._static_key: dict[int, PriorityKey] = {}  # key of every other member (never changes)
        self._static_classes: dict[int, SortedKeys] = {}
        self._groups: dict[tuple[int, int], _Group] = {}
        self._by_gid: dict[int, _Group] = {}
        self._gid = count()
        self._class_heads: dict[int, SortedKeys] = {}  # class -> (first key of a group's part, group)
        self._class_min: dict[int, PriorityKey] = {}   # class -> its least key
        self._class_top = SortedKeys()                 # (least key of a class, class)
        self._dirty: dict[_Group, None] = {}           # groups with members added since their split was found
        self._class_of: dict[int, int] = {}            # size class of each member
        self._rem: dict[int, tuple[int, int]] = {}     # (remaining prefill, id) as filed
        self._by_rem = SortedKeys()
        self._now = -INF
        self._gens: list[_Generation] = [_Generation(self._coefficients())]   # oldest first

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
        self._file(req)
        self._by_rem.add(self._rem[rid])

    def _file(self, req: Request) -> None:
        """Record ``req``: a member with a flipping deadline joins its group (its split found at
        the next :meth:`advance`), any other gets its key."""
        rid = req.request_id
        self._reqs[rid] = req
        self._class_of[rid] = c = _class_of(req)
        self._rem[rid] = (req.remaining_prefill, rid)
        if self.ordering not in _FLIPPING:
            self._add_static(rid, ORDERINGS[self.ordering](req, 0.0, 0.0), c)
            return
        d = req.ttft_deadline
        if d == INF:
            self._add_static(rid, (1, 0.0, req.arrival_time, rid), c)
            return
        tokens = self.step_tokens(req) if self.ordering == "sedf" else 0
        group = self._groups.get((c, tokens))
        member = self._member[rid] = (d, req.arrival_time, rid)
        if group is None:
            group = self._new_group(c, tokens)
            group.split = member                          # positive until the next advance
        elif group.gen is not self._gens[-1]:
            self._reprice(group)
        self._owner[rid] = group
        group.members.add(member)
        group.touched = True
        self._dirty[group] = None                        # its split, heads and checks at the next advance

    def _add_static(self, rid: int, key: PriorityKey, c: int) -> None:
        self._static_key[rid] = key
        members = self._static_classes.get(c)
        if members is None:
            members = self._static_classes[c] = SortedKeys((key,))
        else:
            members.add(key)
        self._owner[rid] = members
        least = self._class_min.get(c)
        if least is None or key < least:
            self._set_class_min(c)

    def discard(self, request_id: int) -> None:
        if self._reqs.pop(request_id, None) is None:
            return
        c = self._class_of.pop(request_id)
        self._by_rem.remove(self._rem.pop(request_id))
        group = self._owner.pop(request_id)
        key = self._static_key.pop(request_id, None)
        if key is not None:
            members = self._static_classes[c]
            members.remove(key)
            if not members:
                del self._static_classes[c]
            if key == self._class_min[c]:
                self._set_class_min(c)
            return
        member = self._member.pop(request_id)
        group.members.remove(member)
        group.touched = True
        if not group.members:
            self._drop(group)
            return
        if group.split == member:                        # the next one is the first positive now
            group.split = group.members.after(member)
        # the checks may now be early (a boundary member left): searched again when due, as usual
        positive, negative = group.heads
        if (positive is not None and positive[3] == request_id) or (negative is not None and negative[3] == request_id):
            self._set_heads(group, group.boundaries()[0])

    def _new_group(self, c: int, tokens: int) -> _Group:
        p = self.predict(tokens) if self.ordering == "sedf" else 0.0
        self.predictions += self.ordering == "sedf"
        group = _Group(next(self._gid), c, tokens, p, self._gens[-1])
        self._groups[(c, tokens)] = group
        self._by_gid[group.gid] = group
        return group

    def _drop(self, group: _Group) -> None:
        """Remove an empty group."""
        c = group.cls
        if group.heads != (None, None):
            heads = self._class_heads[c]
            for key in group.heads:
                if key is not None:
                    heads.remove((key, group))
            if not heads:
                del self._class_heads[c]
            self._set_class_min(c)
        self._unfile(group)
        del self._groups[(group.cls, group.tokens)], self._by_gid[group.gid]
        self._dirty.pop(group, None)
        gen = group.gen
        if gen.size == 0 and gen is not self._gens[-1]:
            self._gens.remove(gen)

    def _unfile(self, group: _Group) -> None:
        """Remove the group's checks from its generation."""
        if group.flip is not None:
            group.gen.remove(group.flip, group.band, True)
            group.flip = None
        if group.unflip is not None:
            group.gen.remove(group.unflip, group.band, False)
            group.unflip = None

    def _reprice(self, group: _Group, search: bool = True) -> None:
        """Re-predict ``group`` under the current fit and file it in the current generation: its
        split is found again at the next search (``search``), or is known not to have moved (a
        group of an older generation whose checks were not due: only its checks are re-filed)."""
        self._unfile(group)
        group.p = self.predict(group.tokens) if self.ordering == "sedf" else 0.0
        self.predictions += self.ordering == "sedf"
        group.gen = self._gens[-1]
        self.rekeys += 1
        if search:
            group.touched = True
            self._dirty[group] = None
        else:
            self._set_checks(group, group.boundaries()[1])

    def _reprice_bulk(self, groups: Iterable[_Group]) -> None:
        """:meth:`_reprice` for many groups at once: each sorted set of checks they leave is
        rebuilt once (filtered), and the predictor is asked once per step-token count."""
        gone: dict[tuple[_Generation, int, bool], set] = {}
        memo: dict[int, float] = {}
        current, sedf = self._gens[-1], self.ordering == "sedf"
        for group in groups:
            for entry, flip in ((group.flip, True), (group.unflip, False)):
                if entry is not None:
                    gone.setdefault((group.gen, group.band, flip), set()).add(entry)
            group.flip = group.unflip = None
            if sedf:
                p = memo.get(group.tokens)
                if p is None:
                    p = memo[group.tokens] = self.predict(group.tokens)
                group.p = p
            group.gen, group.touched = current, True
            self._dirty[group] = None
            self.rekeys += 1
        self.predictions += len(memo)
        for (gen, band, flip), entries in gone.items():
            _replace(gen.flips if flip else gen.unflips, band, entries, [])
            gen.size -= len(entries)

    def _set_heads(self, group: _Group, heads: tuple[PriorityKey | None, PriorityKey | None]) -> None:
        """File the first keys of the group's parts (``heads``: positive, negative) in its
        class's heads."""
        old = group.heads
        if heads == old:
            return
        c = group.cls
        filed = self._class_heads.get(c)
        if filed is None:
            filed = self._class_heads[c] = SortedKeys()
        for was, now in zip(old, heads):
            if was != now:
                if was is not None:
                    filed.remove((was, group))
                if now is not None:
                    filed.add((now, group))
        group.heads = heads
        least = self._class_min.get(c)
        if least is None or least in old or filed.first()[0] < least:
            self._set_class_min(c)

    def _set_class_min(self, c: int) -> None:
        """File class ``c``'s least key (of its parts' first keys) in the class order."""
        heads, members = self._class_heads.get(c), self._static_classes.get(c)
        least = None if not heads else heads.first()[0]
        if members and (least is None or members.first() < least):
            least = members.first()
        old = self._class_min.get(c)
        if least == old:
            return
        if old is not None:
            self._class_top.remove((old, c))
            del self._class_min[c]
        if least is not None:
            self._class_top.add((least, c))
            self._class_min[c] = least

    def _search(self, group: _Group, now: float) -> None:
        """Find the group's split at ``now`` and file its heads and checks."""
        split = group.find_split(now)
        self.searches += 1
        if split == group.split and not group.touched:
            return                                       # nothing moved (a due check within its tolerance)
        group.split, group.touched = split, False
        heads, checks = group.boundaries()
        self._set_heads(group, heads)
        self._set_checks(group, checks)

    def _set_checks(self, group: _Group, checks: tuple[tuple[float, int] | None, tuple[float, int] | None]) -> None:
        """File the group's flip and unflip checks (``checks``) in its generation."""
        gen, band = group.gen, group.band
        for flip, was, now in ((True, group.flip, checks[0]), (False, group.unflip, checks[1])):
            if was != now:
                if was is not None:
                    gen.remove(was, band, flip)
                if now is not None:
                    gen.add(now, band, flip)
        group.flip, group.unflip = checks

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
        if self._gens[-1].size == 0 and not any(g.gen is self._gens[-1] for g in self._dirty):
            self._gens.pop()
        for gen in self._gens:
            gen.bound(current)
        self._gens.append(_Generation(current))

    # ---- time ------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Bring every sign to ``now``: re-predict the groups a refit may have moved (see the
        module docstring) and some more of the older generations, then find the splits of the
        groups whose flip check is due (or, after a step back in time, whose unflip check is)."""
        if self.ordering not in _FLIPPING:
            return
        self._sync()
        back = now < self._now
        self._now = now
        if len(self._gens) > 1:
            self._migrate_due(now)
        self._settle(now, back)

    def _migrate_due(self, now: float) -> None:
        """Re-predict and search every group of an older generation whose split may have moved,
        then up to :data:`MIGRATE_BATCH` more (oldest generation first)."""
        margin = _MARGIN * (abs(now) + 1.0)
        by_gid, due = self._by_gid, {}
        for gen in self._gens[:-1]:
            for band, flips in gen.flips.items():
                limit = now + gen.up[band] + margin
                if flips.first()[0] <= limit:
                    checks = flips.to_list()
                    for check in checks[:bisect_right(checks, (limit, INF))]:
                        due[by_gid[check[1]]] = None
            for band, unflips in gen.unflips.items():
                limit = now - gen.down[band] - margin
                if unflips.last()[0] >= limit:
                    checks = unflips.to_list()
                    for check in checks[bisect_left(checks, (limit, -INF)):]:
                        due[by_gid[check[1]]] = None
        if len(due) > BULK_SEARCH:
            self._reprice_bulk(due)
        else:
            for group in due:
                self._reprice(group)
        budget = MIGRATE_BATCH
        for gen in self._gens[:-1]:
            while budget > 0 and gen.size:
                sets = gen.flips or gen.unflips
                checks = next(iter(sets.values()))
                entry = checks.first() if sets is gen.flips else checks.last()
                self._reprice(by_gid[entry[1]], search=False)
                budget -= 1
            if budget <= 0:
                break
        self._gens = [g for g in self._gens[:-1] if g.size] + [self._gens[-1]]

    def _settle(self, now: float, back: bool) -> None:
        gen, by_gid = self._gens[-1], self._by_gid
        todo, self._dirty = self._dirty, {}
        for flips in gen.flips.values():
            if flips.first()[0] > now:
                continue
            checks = flips.to_list()
            for check in checks[:bisect_right(checks, (now, INF))]:
                todo[by_gid[check[1]]] = None
        if back:
            limit = now - _MARGIN * (abs(now) + 1.0)
            for unflips in gen.unflips.values():
                for check in reversed(unflips):
                    if check[0] < limit:
                        break
                    todo[by_gid[check[1]]] = None
        for group in todo:
            if group.gen is not gen:                     # filled before a refit: re-predict it first
                self._reprice(group)
                self._dirty.pop(group, None)
        if len(todo) > BULK_SEARCH:
            self._search_bulk(todo, now)
            return
        for group in todo:
            self._search(group, now)

    def _search_bulk(self, groups: Iterable[_Group], now: float) -> None:
        """:meth:`_search` for many groups (of the current generation) at once: the same splits,
        heads and checks, but each sorted set of heads or checks they change is rebuilt once (the
        kept entries merged with the new ones, a linear merge in C) instead of changed one entry
        at a time; a group of one member is searched without the bisection machinery."""
        gen = self._gens[-1]
        heads_of: dict[int, tuple[set, list]] = {}       # class -> (first keys gone, entries added)
        checks_of: dict[tuple[int, bool], tuple[set, list]] = {}    # (band, flip) -> (gone, added)
        searched = 0
        for group in groups:
            split = group.find_split(now)
            searched += 1
            if split == group.split and not group.touched:
                continue
            group.split, group.touched = split, False
            heads, checks = group.boundaries()
            if heads != group.heads:
                gone, added = heads_of.setdefault(group.cls, (set(), []))
                for was, key in zip(group.heads, heads):
                    if was != key:
                        if was is not None:
                            gone.add(was)
                        if key is not None:
                            added.append((key, group))
                group.heads = heads
            for flip, was, check in ((True, group.flip, checks[0]), (False, group.unflip, checks[1])):
                if was != check:
                    gone, added = checks_of.setdefault((group.band, flip), (set(), []))
                    if was is not None:
                        gone.add(was)
                    if check is not None:
                        added.append(check)
            group.flip, group.unflip = checks
        self.searches += searched
        for c, (gone, added) in heads_of.items():
            _replace(self._class_heads, c, gone, added, _first)
            self._set_class_min(c)
        for (band, flip), (gone, added) in checks_of.items():
            _replace(gen.flips if flip else gen.unflips, band, gone, added)
            gen.size += len(added) - len(gone)

    def rebuild(self) -> None:
        """Re-predict every group and find every split afresh (for a new predictor): signs are
        positive again until the next :meth:`advance`."""
        members = list(self._reqs.values())
        self._reset()
        for req in members:
            self._file(req)
        for group in self._groups.values():
            self.rekeys += 1
            group.split = group.members.first()
            self._set_heads(group, group.boundaries()[0])
        self._by_rem = SortedKeys(self._rem.values())

    # ---- queries ---------------------------------------------------------------------------
    def top(self) -> tuple[PriorityKey, Request] | None:
        """The best member (call :meth:`advance` first)."""
        first = self._class_top.first()
        return None if first is None else (first[0], self._reqs[first[0][3]])

    def ordered(self) -> Iterator[tuple[PriorityKey, Request]]:
        """Members best first, lazily (call :meth:`advance` first; removals during the walk are
        fine)."""
        reqs = self._reqs
        for key in self._walk(None):
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
        for key in self._walk(after, bound, floor, fresh_bound):
            yield reqs[key[3]]

    def ordered_admissible(self, after: PriorityKey, fresh_bound: Callable[[], float]
                           ) -> Iterator[tuple[PriorityKey, Request]]:
        """Members ranked after ``after``, best first, lazily, leaving out those not started
        whose remaining prompt tokens are at or above ``fresh_bound()`` (re-read at every step,
        may only shrink): after a prompt of that many tokens found no KV memory, none of them
        can be admitted, while the started hold theirs. Removals during the walk are fine."""
        reqs = self._reqs
        for key in self._walk(after, lambda: INF, 0, fresh_bound):
            yield key, reqs[key[3]]

    def _walk(self, after: PriorityKey | None, bound: Callable[[], float] | None = None, floor: int = 0,
              fresh_bound: Callable[[], float] | None = None) -> Iterator[PriorityKey]:
        """The keys after ``after`` (all with None) of the classes that may hold a member under
        the bounds (every class without ``bound``), in order: a merge over those classes (entries
        ``(least key, class, class floor, started)``; a class is dropped when the bounds pass
        it), each a merge over its parts (its groups' positive and negative parts, its members
        without a deadline) built when the class is first reached."""
        limit = INF if bound is None else bound()
        fresh = limit if fresh_bound is None else min(limit, fresh_bound())
        classes = self._class_top.to_list()             # sorted: a heap already
        if bound is None:                                 # every class, none ever dropped
            outer = [(key, c, 0, False) for key, c in classes]
        else:
            outer = []
            for key, c in classes:
                lo, hi = _filed_range(c)
                if lo < (fresh if c >= 0 else limit) and hi > floor:
                    outer.append((key, c, lo, c < 0))
        inner: dict[int, list] = {}
        owner = self._owner
        while outer:
            key, c, lo, started = outer[0]
            if lo >= (limit if started else fresh):
                heapq.heappop(outer)                      # the class cannot fit any more: drop it
                continue
            parts = inner.get(c)
            if parts is None:
                parts = inner[c] = self._parts(c, after)
                if not parts:
                    heapq.heappop(outer)
                    continue
                if parts[0][0] != key:                    # its first key after ``after``
                    heapq.heapreplace(outer, (parts[0][0], c, lo, started))
                    continue
            key, part = parts[0]
            if owner.get(key[3]) is part:                 # not removed during the walk
                yield key
                if bound is not None:
                    limit = bound()
                    fresh = limit if fresh_bound is None else min(limit, fresh_bound())
            nxt = part.after(key)
            if nxt is None:
                heapq.heappop(parts)
            else:
                heapq.heapreplace(parts, (nxt, part))
            if parts:
                heapq.heapreplace(outer, (parts[0][0], c, lo, started))
            else:
                heapq.heappop(outer)

    def _parts(self, c: int, after: PriorityKey | None) -> list:
        """A heap of ``(first key after after, part)`` over class ``c``'s parts."""
        heads = self._class_heads.get(c)
        parts = heads.to_list() if heads else []         # sorted: a heap already
        if after is not None and parts:
            cut = bisect_right(parts, after, key=_first)
            if cut:                                       # parts starting at or before ``after``
                moved = [(k, g) for key, g in parts[:cut] if (k := g.first_after(key[0] == 0, after)) is not None]
                parts = parts[cut:]
                for entry in moved:
                    heapq.heappush(parts, entry)
        members = self._static_classes.get(c)
        if members:
            first = members.first() if after is None else members.after(after)
            if first is not None:
                heapq.heappush(parts, (first, members))
        return parts

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
        """A new TTFT predictor (bound cost model): every group is re-predicted."""
        self.predict = predict
        self._version = getattr(predict, "version", None)
        self.rebuild()
