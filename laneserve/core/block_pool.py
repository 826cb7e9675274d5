"""Reference-counted KV blocks with content names, the pool under every
:class:`~laneserve.core.kv.KVCacheManager` (vLLM's automatic prefix caching, SGLang's radix cache
at block granularity).

A block is *free* (on the free list, holds nothing), *used* (``refcount > 0``: in the tables of
that many requests) or *cached* (``refcount == 0`` but named by a content hash: its KV is kept for a
later request with the same prefix). Cached blocks count as available: :meth:`BlockPool.allocate`
takes free blocks first and then evicts cached ones, least recently released first. Requests
release their blocks tail first (:meth:`BlockPool.free` walks the table backwards) and a block is
only referenced together with all its ancestors, so a chain's later blocks are always older than
its earlier ones and eviction trims chains from their leaves.

Names come from :func:`chain_hashes` for the engine (a hash chain over token ids) or from the
workload for the simulator (any hashable): the pool only maps names to blocks. A name is held by
one block at a time; registering a second block under a name already held leaves that block
unnamed (it is freed, not cached, when released).

Hash choice: ``hashlib.blake2b`` with a 16-byte digest over ``parent digest || token ids as
little-endian int64``. It is deterministic across processes and machines (Python's ``hash`` is
salted per process for str/bytes and only 64 bits, with easy collisions between int tuples), and a
128-bit cryptographic digest makes two different prefixes sharing a name a 2^-64 birthday event
even over 10^9 blocks. The parent digest has a fixed length, so the byte string fed to the hash
decodes uniquely into (parent, tokens): equal names need equal parents and equal tokens, i.e. equal
whole prefixes. The chain's root is the digest of ``cache_key`` (model id, and later a LoRA id), so
two models never share a block.

Pure Python: no torch.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Sequence
from hashlib import blake2b

DIGEST_BYTES = 16
#: kinds of :attr:`BlockPool.events`
STORED, REMOVED = 1, 0


class KVOutOfMemory(RuntimeError):
    """Raised when an allocation is attempted without enough free (or evictable) blocks."""


def chain_root(cache_key: bytes = b"") -> bytes:
    """The parent digest of a chain's first block: everything that changes KV besides the tokens."""
    return blake2b(b"laneserve-kv-root\0" + cache_key, digest_size=DIGEST_BYTES).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes, start_block: int = 0,
                 num_blocks: int | None = None) -> list[bytes]:
    """Names of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids`` (at most
    ``num_blocks`` of them), chained from ``parent`` (the name of block ``start_block - 1``, or
    :func:`chain_root` for block 0)."""
    end = len(token_ids) // block_size
    if num_blocks is not None:
        end = min(end, start_block + num_blocks)
    pack = struct.Struct(f"<{block_size}q").pack
    out: list[bytes] = []
    for b in range(start_block, end):
        parent = blake2b(parent + pack(*token_ids[b * block_size:(b + 1) * block_size]),
                         digest_size=DIGEST_BYTES).digest()
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` blocks: LIFO free list, reference counts, names, and cached blocks in LRU
    order. A release of a block nobody holds (double or foreign free) raises ``ValueError``."""

    __slots__ = ("num_blocks", "_free", "_refs", "_cached", "_name_of", "_block_of", "evicted", "events")
    #: whether blocks carry reference counts (:class:`ExclusiveBlockPool` keeps none)
    counts_refs = True

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks if self.counts_refs else []
        self._cached: dict[int, None] = {}            # refcount 0 and named; insertion order = LRU first
        self._name_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.evicted = 0                              # cached blocks reclaimed for new allocations
        #: when a list (:meth:`record_events`): ``(STORED | REMOVED, name)`` in the order names
        #: appear and disappear, for the router's summary of what this instance holds
        self.events: list[tuple[int, Hashable]] | None = None

    def record_events(self) -> None:
        """Log every name added and dropped from now on (:attr:`events`, drained by :meth:`take_events`)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[tuple[int, Hashable]]:
        """The logged name events since the last call, oldest first (empty when not recording)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_named(self) -> int:
        return len(self._block_of)

    def cached_blocks(self) -> list[int]:
        """The cached (evictable) blocks, least recently released first."""
        return list(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def name_of(self, block: int) -> Hashable | None:
        return self._name_of.get(block)

    def lookup(self, names: Iterable[Hashable]) -> list[int]:
        """Blocks holding the longest run of leading ``names`` (used or cached)."""
        block_of = self._block_of
        out: list[int] = []
        for name in names:
            b = block_of.get(name)
            if b is None:
                break
            out.append(b)
        return out

    def num_reclaimed(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are cached now (taking them uses up available blocks)."""
        refs = self._refs
        return sum(1 for b in blocks if refs[b] == 0)

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` unnamed blocks with refcount 1: free ones first, then the least recently
        released cached ones (their names dropped). Raises :class:`KVOutOfMemory`, taking nothing."""
        if n <= 0:
            return []
        free = self._free
        if n > len(free) + len(self._cached):
            raise KVOutOfMemory(f"need {n} blocks, {self.num_free} free of {self.num_blocks}")
        short = n - len(free)
        if short > 0:
            self._evict(short)
        blocks = free[-n:]
        del free[-n:]
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def _evict(self, n: int) -> None:
        cached, name_of, block_of, free = self._cached, self._name_of, self._block_of, self._free
        victims = []
        for b in cached:
            victims.append(b)
            if len(victims) == n:
                break
        events = self.events
        for b in victims:
            del cached[b]
            name = name_of.pop(b)
            del block_of[name]
            if events is not None:
                events.append((REMOVED, name))
        victims.reverse()
        free.extend(victims)
        self.evicted += n

    def ref(self, blocks: Sequence[int]) -> None:
        """One more holder of each of ``blocks`` (used or cached; a cached block becomes used)."""
        refs, cached = self._refs, self._cached
        for b in blocks:
            if refs[b] == 0:
                if b not in cached:
                    raise ValueError(f"block {b} is free: only used or cached blocks can be shared")
                del cached[b]
            refs[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """One holder fewer for each of ``blocks`` (a table, in order). Released blocks that are
        named become cached, the table's tail first (so its head stays the most recent); the others
        go back to the free list."""
        refs = self._refs
        if not self._name_of:
            # the common case, nothing named and every block held once: one pass, all go free
            for b in blocks:
                if refs[b] != 1:
                    break
                refs[b] = 0
            else:
                self._free.extend(blocks)
                return
            # shared, or a bad release: undo, take the general path. The pass zeroed the blocks
            # before b's first place in the table, or before its second when it zeroed b itself
            # (b listed twice, held once: neither free nor cached)
            i = blocks.index(b)
            if refs[b] == 0 and b not in self._cached and b not in self._free:
                i = blocks.index(b, i + 1)
            for c in blocks[:i]:
                refs[c] = 1
        for i, b in enumerate(blocks):
            if refs[b] <= 0:
                for c in blocks[:i]:                  # nothing changes on a bad release
                    refs[c] += 1
                raise ValueError(f"block {b} freed twice or never allocated")
            refs[b] -= 1
        name_of = self._name_of
        if not name_of:                               # nothing named: every released block is free
            self._free.extend([b for b in blocks if refs[b] == 0])
            return
        cached = self._cached
        released: list[int] = []
        for b in reversed(blocks):
            if refs[b] == 0:
                if b in name_of:
                    cached[b] = None
                else:
                    released.append(b)
        released.reverse()
        self._free.extend(released)

    def name(self, block: int, name: Hashable) -> bool:
        """Register used ``block``'s content as ``name``; False (nothing changes) if another block
        holds that name already or ``block`` has a name."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not in use: only a request's own block can be named")
        if name in self._block_of or block in self._name_of:
            return False
        self._block_of[name] = block
        self._name_of[block] = name
        if self.events is not None:
            self.events.append((STORED, name))
        return True

    def forget(self, block: int) -> None:
        """Drop used ``block``'s name: it is freed, not cached, when released."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not in use")
        name = self._name_of.pop(block, None)
        if name is not None:
            del self._block_of[name]
            if self.events is not None:
                self.events.append((REMOVED, name))

    def check(self) -> None:
        """Assert the pool's invariants (tests): every block in exactly one state, names bijective."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cached = set(self._cached)
        used = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block leaked"
        assert all(self._refs[b] == 0 for b in free | cached)
        assert cached <= set(self._name_of) and not (free & set(self._name_of))
        assert all(self._block_of[n] == b for b, n in self._name_of.items())
        assert len(self._block_of) == len(self._name_of)


class ExclusiveBlockPool(BlockPool):
    """A pool whose blocks are never shared or named: each used block is in exactly one table
    (the simulator's KV without prefix caching or forks). Reference counts would all be 1, so they
    are not kept: allocation and release are list operations, without the per-block bookkeeping
    that is most of :class:`BlockPool`'s cost when a simulation grows millions of blocks.

    What it gives up: a release is checked only against the pool's size (freeing more blocks than
    are in use raises ``ValueError``), not block by block; a :class:`~laneserve.core.kv.KVCacheManager`
    releases each table once (it pops the table first), so through the manager a double free
    cannot happen. Sharing (:meth:`ref`, :meth:`name`) raises ``ValueError``."""

    __slots__ = ()
    counts_refs = False

    def refcount(self, block: int) -> int:
        """1 when used, 0 when free (a scan of the free list: tests and debugging only)."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(block)
        return 0 if block in self._free else 1

    def num_reclaimed(self, blocks: Sequence[int]) -> int:
        return 0                                      # nothing is ever cached

    def allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        free = self._free
        if n > len(free):
            raise KVOutOfMemory(f"need {n} blocks, {len(free)} free of {self.num_blocks}")
        blocks = free[-n:]
        del free[-n:]
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        free = self._free
        if len(free) + len(blocks) > self.num_blocks:
            raise ValueError(f"{len(blocks)} blocks released with only "
                             f"{self.num_blocks - len(free)} in use: a double or foreign free")
        free.extend(blocks)

    def ref(self, blocks: Sequence[int]) -> None:
        raise ValueError("an exclusive block pool shares no blocks (fork or prefix caching need BlockPool)")

    def name(self, block: int, name: Hashable) -> bool:
        raise ValueError("an exclusive block pool names no blocks (prefix caching needs BlockPool)")

    def forget(self, block: int) -> None:
        """Nothing is named: nothing to drop."""

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free <= set(range(self.num_blocks))
        assert not self._cached and not self._name_of and not self._block_of
