"""The quad-tree over KV length that indexes AlignedServe's host KV pool (AlignedServe §3.3).

Each internal node covers a range of KV lengths split into four equal sub-ranges, and keeps the
tuple (request counter, block counter) of its subtree plus the entry time of its oldest request
(the subtree's starvation timer, §3.5). Leaves (ranges of ``leaf_width`` lengths) hold the
requests. The whole range is ``[1, 65536]`` (§4.1); longer KV lengths count as 65536.

Density-first search (Algorithm 1): from the root, a subtree whose blocks fit the threshold and
that holds at least ``n_min`` requests becomes a batch (case 1); a subtree with too many blocks
sends the search into the child with the most requests (case 2); a subtree with too few requests
is widened from its parent (case 3) by L-Search (siblings on the left, scanned right to left) and
then R-Search (siblings on the right, scanned left to right), climbing further up while the batch
is still short of ``n_min``, so that its lengths stay in as small a range as possible. A sibling
that does not fit the remaining block budget whole is entered from the end nearest to the batch.

Each leaf keeps its entries in two sorted sets, by ``(length, since, seq)`` and by ``(since, seq)``
(``seq`` numbers insertions: a leaf's insertion order), so the walks in length order, the oldest
request of a leaf and the oldest-first walks cost O(log n) per entry visited instead of a sort or
scan of the leaf per call (ties are broken exactly as the sorts they replace).

Choices where the paper is silent (documented, reported): widening stops as soon as ``n_min`` is
reached (whole subtrees are taken when they fit); a leaf too large for the budget gives its
oldest requests first; when even the root cannot give ``n_min`` requests the search returns the
best under-filled selection with ``full=False`` and the scheduler decides whether to use it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import groupby

from laneserve.core.sorted_keys import SortedKeys

MAX_LEN = 65536
_INF = float("inf")


@dataclass(slots=True)
class TreeEntry:
    request_id: int
    length: int           # KV length, clamped to [1, MAX_LEN]
    blocks: int           # KV blocks the request holds
    since: float          # when it (re)entered the pool: its starvation timer
    leaf: QuadNode | None = None
    seq: int = 0          # insertion number (ties in the leaf's orders)


@dataclass(slots=True, eq=False)
class QuadNode:
    lo: int                               # inclusive length range [lo, hi]
    hi: int
    parent: QuadNode | None = None
    children: list[QuadNode] | None = None
    entries: dict[int, TreeEntry] | None = None   # leaves only
    by_length: SortedKeys | None = None           # leaves: (length, since, seq, id)
    by_since: SortedKeys | None = None            # leaves: (since, seq, id)
    num_requests: int = 0
    num_blocks: int = 0
    oldest: float = _INF

    def __repr__(self) -> str:
        return f"QuadNode[{self.lo},{self.hi}] reqs={self.num_requests} blocks={self.num_blocks}"


@dataclass(slots=True)
class Selection:
    """A batch found by the search: request ids (in length order), their length range and blocks;
    ``full`` when it met ``n_min``."""

    request_ids: list[int] = field(default_factory=list)
    lo: int = MAX_LEN
    hi: int = 0
    blocks: int = 0
    full: bool = False

    def __len__(self) -> int:
        return len(self.request_ids)


class KVLengthQuadTree:
    """Requests indexed by KV length; counters on every node; insert / remove / update in
    O(depth) (leaves rescan their own entries for the oldest-timer on removal)."""

    def __init__(self, leaf_width: int = 64, max_len: int = MAX_LEN) -> None:
        if leaf_width < 1 or max_len < leaf_width:
            raise ValueError("need 1 <= leaf_width <= max_len")
        self.leaf_width = leaf_width
        self.max_len = max_len
        self.root = self._node(1, max_len, None)
        self._entries: dict[int, TreeEntry] = {}
        self._seq = 0

    def _node(self, lo: int, hi: int, parent: QuadNode | None) -> QuadNode:
        node = QuadNode(lo, hi, parent)
        if hi - lo + 1 <= self.leaf_width:
            node.entries, node.by_length, node.by_since = {}, SortedKeys(), SortedKeys()
        return node

    # ---- queries --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._entries

    def entry(self, request_id: int) -> TreeEntry:
        return self._entries[request_id]

    @property
    def num_blocks(self) -> int:
        return self.root.num_blocks

    def clamp(self, length: int) -> int:
        return 1 if length < 1 else (self.max_len if length > self.max_len else length)

    # ---- changes --------------------------------------------------------------------------
    def _leaf_for(self, length: int) -> QuadNode:
        node = self.root
        while node.entries is None:
            if node.children is None:
                width = (node.hi - node.lo + 1) // 4
                node.children = [self._node(node.lo + k * width, node.lo + (k + 1) * width - 1, node)
                                 for k in range(4)]
                node.children[-1].hi = node.hi
            width = node.children[0].hi - node.children[0].lo + 1
            node = node.children[min((length - node.lo) // width, 3)]
        return node

    def insert(self, request_id: int, length: int, blocks: int, since: float) -> TreeEntry:
        if request_id in self._entries:
            raise ValueError(f"request {request_id} already in the tree")
        self._seq += 1
        entry = TreeEntry(request_id, self.clamp(length), blocks, since, seq=self._seq)
        leaf = self._leaf_for(entry.length)
        entry.leaf = leaf
        leaf.entries[request_id] = entry  # type: ignore[index]
        leaf.by_length.add((entry.length, since, entry.seq, request_id))  # type: ignore[union-attr]
        leaf.by_since.add((since, entry.seq, request_id))  # type: ignore[union-attr]
        self._entries[request_id] = entry
        node: QuadNode | None = leaf
        while node is not None:
            node.num_requests += 1
            node.num_blocks += blocks
            if since < node.oldest:
                node.oldest = since
            node = node.parent
        return entry

    def remove(self, request_id: int) -> TreeEntry:
        entry = self._entries.pop(request_id)
        leaf = entry.leaf
        del leaf.entries[request_id]  # type: ignore[union-attr,arg-type]
        leaf.by_length.remove((entry.length, entry.since, entry.seq, request_id))  # type: ignore[union-attr]
        leaf.by_since.remove((entry.since, entry.seq, request_id))  # type: ignore[union-attr]
        node: QuadNode | None = leaf
        recompute = entry.since <= leaf.oldest  # type: ignore[union-attr]
        while node is not None:
            node.num_requests -= 1
            node.num_blocks -= entry.blocks
            if recompute:
                if node.entries is not None:
                    first = node.by_since.first()  # type: ignore[union-attr]
                    node.oldest = _INF if first is None else first[0]
                else:
                    node.oldest = min(c.oldest for c in node.children)  # type: ignore[union-attr]
            node = node.parent
        entry.leaf = None
        return entry

    def update(self, request_id: int, length: int, blocks: int) -> TreeEntry:
        """A request's KV grew (or shrank): move it, keeping its timer."""
        since = self._entries[request_id].since
        self.remove(request_id)
        return self.insert(request_id, length, blocks, since)

    # ---- traversal ------------------------------------------------------------------------
    def iter_entries(self, node: QuadNode | None = None, *, descending: bool = False):
        """Entries of a subtree in length order (ties: oldest first)."""
        node = node or self.root
        if node.num_requests == 0:
            return
        if node.entries is not None:
            entries = node.entries
            if not descending:
                for key in node.by_length:  # type: ignore[union-attr]
                    yield entries[key[3]]
                return
            # descending: equal (length, since) keep their insertion order, as a stable sort's
            for _, run in groupby(reversed(node.by_length), key=lambda k: k[:2]):  # type: ignore[arg-type]
                for key in reversed(list(run)):
                    yield entries[key[3]]
            return
        kids = node.children or []
        for child in (reversed(kids) if descending else kids):
            yield from self.iter_entries(child, descending=descending)

    def in_range(self, lo: int, hi: int, limit: int) -> list[TreeEntry]:
        """Up to ``limit`` entries with length in ``[lo, hi]``, oldest first (ties: the leaf
        with the longer lengths first, then insertion order)."""
        leaves: list[QuadNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.num_requests == 0 or node.hi < lo or node.lo > hi:
                continue
            if node.entries is not None:
                leaves.append(node)
            else:
                stack.extend(node.children or [])

        def oldest_first(leaf: QuadNode) -> Iterator[tuple[float, int, int, int]]:
            inside = lo <= leaf.lo and leaf.hi <= hi
            entries = leaf.entries
            for since, seq, rid in leaf.by_since:  # type: ignore[union-attr]
                if inside or lo <= entries[rid].length <= hi:  # type: ignore[index]
                    yield since, -leaf.lo, seq, rid
        found = []
        for *_, rid in heapq.merge(*map(oldest_first, leaves)):
            if len(found) >= limit:
                break
            found.append(self._entries[rid])
        return found

    def oldest(self, node: QuadNode) -> TreeEntry:
        """The subtree's oldest entry (ties: shortest, then first inserted)."""
        return next(self._oldest_first(node))

    def _oldest_first(self, node: QuadNode) -> Iterator[TreeEntry]:
        """A subtree's entries oldest first, lazily; ties in length order, then insertion order
        (a stable sort of :meth:`iter_entries` by ``since``)."""
        leaves, stack = [], [node]
        while stack:
            n = stack.pop()
            if n.num_requests:
                if n.entries is not None:
                    leaves.append(n.by_since)
                else:
                    stack.extend(n.children or [])
        entries = self._entries
        for _, run in groupby(heapq.merge(*leaves), key=lambda k: k[0]):
            run = [entries[k[2]] for k in run]
            if len(run) > 1:
                run.sort(key=lambda e: (e.length, e.seq))
            yield from run

    def starving_leaf(self, now: float, bound: float) -> QuadNode | None:
        """The leaf holding the oldest request when that request has waited longer than
        ``bound`` (the subtree timers of §3.5), else None."""
        node = self.root
        if node.num_requests == 0 or now - node.oldest <= bound:
            return None
        while node.entries is None:
            node = min((c for c in node.children if c.num_requests), key=lambda c: c.oldest)  # type: ignore[union-attr]
        return node

    # ---- density-first search (Algorithm 1) ----------------------------------------------
    def density_first(self, threshold_blocks: int, n_min: int, max_requests: int) -> Selection | None:
        node = self.root
        if node.num_requests == 0:
            return None
        while node.num_blocks > threshold_blocks and node.entries is None:      # case 2
            node = max((c for c in node.children if c.num_requests),             # type: ignore[union-attr]
                       key=lambda c: c.num_requests)
        return self.grow(node, threshold_blocks, n_min, max_requests)

    def grow(self, seed: QuadNode, threshold_blocks: int, n_min: int, max_requests: int,
             *, force_one: bool = False) -> Selection:
        """Case 1 at ``seed`` if it fits and holds ``n_min`` requests; otherwise case 3: widen
        through the ancestors' siblings (L-Search, then R-Search) until ``n_min`` is reached or
        the block budget is spent. ``force_one`` takes the seed's oldest request even when it
        alone exceeds the budget (starvation: a request longer than the threshold)."""
        sel = Selection()
        budget = [threshold_blocks]
        if seed.num_blocks <= threshold_blocks and seed.num_requests <= max_requests:
            self._take_all(seed, sel, budget)
        else:   # a leaf (or a capped subtree) larger than the budget: oldest first
            for e in self._oldest_first(seed):
                if len(sel) >= max_requests or (e.blocks > budget[0] and not (force_one and not sel)):
                    break
                self._pick(e, sel, budget)
        if not sel and force_one and seed.num_requests:
            self._pick(self.oldest(seed), sel, budget)
        node = seed
        while len(sel) < n_min and node.parent is not None and budget[0] > 0 and len(sel) < max_requests:
            parent = node.parent
            kids = parent.children or []
            i = kids.index(node)
            done = False
            for sib in reversed(kids[:i]):                    # L-Search: right to left
                if done := self._take_part(sib, sel, budget, n_min, max_requests, descending=True):
                    break
            if not done:
                for sib in kids[i + 1:]:                      # R-Search: left to right
                    if self._take_part(sib, sel, budget, n_min, max_requests, descending=False):
                        break
            node = parent
        sel.full = len(sel) >= n_min
        sel.request_ids.sort(key=lambda rid: self._entries[rid].length)
        return sel

    def _pick(self, e: TreeEntry, sel: Selection, budget: list[int]) -> None:
        sel.request_ids.append(e.request_id)
        sel.blocks += e.blocks
        budget[0] -= e.blocks
        sel.lo = min(sel.lo, e.length)
        sel.hi = max(sel.hi, e.length)

    def _take_all(self, node: QuadNode, sel: Selection, budget: list[int]) -> None:
        for e in self.iter_entries(node):
            self._pick(e, sel, budget)

    def _take_part(self, node: QuadNode, sel: Selection, budget: list[int], n_min: int,
                   max_requests: int, *, descending: bool) -> bool:
        """Take ``node``'s requests from the end nearest the batch; True when the selection is
        complete (``n_min`` reached, budget or request cap spent)."""
        if node.num_requests == 0:
            return False
        if node.num_blocks <= budget[0] and len(sel) + node.num_requests <= max_requests:
            self._take_all(node, sel, budget)
        elif node.entries is None:
            kids = node.children or []
            for child in (reversed(kids) if descending else kids):
                if self._take_part(child, sel, budget, n_min, max_requests, descending=descending):
                    return True
            return budget[0] <= 0 or len(sel) >= max_requests
        else:
            for e in self.iter_entries(node, descending=descending):
                if e.blocks > budget[0] or len(sel) >= max_requests:
                    budget[0] = min(budget[0], 0)   # keep the range contiguous: stop at a misfit
                    return True
                self._pick(e, sel, budget)
                if len(sel) >= n_min:
                    return True
        return len(sel) >= n_min or budget[0] <= 0 or len(sel) >= max_requests

    # ---- checking (tests) -----------------------------------------------------------------
    def check(self) -> None:
        """Recount every node from its leaves; raise AssertionError on any mismatch."""
        def walk(node: QuadNode) -> tuple[int, int, float]:
            if node.entries is not None:
                for e in node.entries.values():
                    assert e.leaf is node and node.lo <= e.length <= node.hi, e
                assert list(node.by_length) == sorted(  # type: ignore[arg-type]
                    (e.length, e.since, e.seq, e.request_id) for e in node.entries.values())
                assert list(node.by_since) == sorted(  # type: ignore[arg-type]
                    (e.since, e.seq, e.request_id) for e in node.entries.values())
                got = (len(node.entries), sum(e.blocks for e in node.entries.values()),
                       min((e.since for e in node.entries.values()), default=_INF))
            elif node.children is None:
                got = (0, 0, _INF)
            else:
                parts = [walk(c) for c in node.children]
                assert node.children[0].lo == node.lo and node.children[-1].hi == node.hi
                got = (sum(p[0] for p in parts), sum(p[1] for p in parts), min(p[2] for p in parts))
            assert (node.num_requests, node.num_blocks, node.oldest) == got, (node, got)
            return got
        total = walk(self.root)
        assert total[0] == len(self._entries)
