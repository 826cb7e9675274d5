"""The reference-counted block pool and prefix-caching KV manager (core/block_pool.py, core/kv.py):
hash chain, cached blocks counted as free, LRU leaves-first eviction, fork, and a property test
over random sessions that tracks what every block holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from laneserve.core.block_pool import BlockPool, ExclusiveBlockPool, KVOutOfMemory, chain_hashes, chain_root
from laneserve.core.kv import KVCacheManager
from laneserve.core.request import Request
from laneserve.core.slo import SLO


def _req(rid: int, tokens: list[int]) -> Request:
    return Request(request_id=rid, arrival_time=0.0, prompt_len=len(tokens), max_output_tokens=1000,
                   slo=SLO(), prompt_token_ids=list(tokens))


def _prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` on its cached prefix, 'compute' the rest, name its blocks; returns cached tokens."""
    cached = kv.match(req)
    kv.allocate(req.request_id, req.prompt_len, cached)
    req.num_computed_tokens = req.prompt_len
    kv.register(req)
    return len(cached) * kv.block_size


# ---- the hash chain ----------------------------------------------------------------------------
def test_chain_names_a_block_by_its_whole_prefix():
    root = chain_root(b"model-a")
    a = chain_hashes([1, 2, 3, 4], 2, root)
    b = chain_hashes([9, 2, 3, 4], 2, root)          # same second block, different first
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert chain_hashes([1, 2, 3, 4, 5], 2, root) == a        # a partial tail block is not named
    assert chain_hashes([1, 2, 3, 4], 2, chain_root(b"model-b")) != a
    assert chain_hashes([1, 2, 3, 4], 4, root)[0] not in a    # another block size, another name
    # resuming the chain from a block's name gives the same names as hashing from the start
    assert chain_hashes([1, 2, 3, 4], 2, a[0], start_block=1) == a[1:]


def test_chain_is_deterministic_across_processes():
    code = ("from laneserve.core.block_pool import chain_hashes, chain_root;"
            "print(chain_hashes(list(range(64)), 16, chain_root(b'm'))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {chain_hashes(list(range(64)), 16, chain_root(b"m"))[-1].hex()}


def test_no_two_prefixes_share_a_name():
    """Every prefix of length 1..6 over a two-letter alphabet, block size 1 and 2: distinct prefixes,
    distinct names (equal blocks in different positions or after different prefixes included)."""
    from itertools import product
    root = chain_root()
    for bs in (1, 2):
        seen: dict[bytes, tuple[int, ...]] = {}
        for n in range(1, 7):
            for tokens in product((0, 1), repeat=n):
                if n % bs:
                    continue
                name = chain_hashes(tokens, bs, root)[-1]
                assert seen.setdefault(name, tokens) == tokens


# ---- the manager -------------------------------------------------------------------------------
def test_cached_blocks_are_reused_and_one_token_is_left_to_compute():
    kv = KVCacheManager(16, 4, prefix_caching=True)
    assert _prefill(kv, _req(1, list(range(10)))) == 0
    kv.free(1)
    assert kv.num_free_blocks == 16 and kv.allocator.num_cached == 2      # 2 full blocks kept
    assert _prefill(kv, _req(2, list(range(10)) + [77])) == 8
    assert kv.table(2)[:2] == kv.allocator.lookup(chain_hashes(list(range(8)), 4, chain_root()))
    # a prompt that is exactly its cached blocks recomputes its whole last block
    assert _prefill(kv, _req(3, list(range(8)))) == 4
    assert kv.hit_tokens == 0 and kv.query_tokens == 0      # counted by the scheduler, not here


def test_cached_blocks_count_as_free_and_admission_charges_reclaimed_ones():
    kv = KVCacheManager(4, 2, prefix_caching=True)
    _prefill(kv, _req(1, [1, 2, 3, 4, 5, 6, 7, 8]))
    kv.free(1)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    req = _req(2, [1, 2, 3, 4, 5, 6, 9, 9])
    cached = kv.match(req)
    assert len(cached) == 3
    # 4 blocks: 3 cached (taking them uses 3 available) + 1 new
    assert kv.blocks_needed(2, 8, cached) == 4 and kv.can_admit(2, 8, cached)
    other = _req(3, [5, 5])
    kv.allocate(3, 2)                               # evicts the oldest cached block: the chain's leaf
    assert kv.match(req) == cached[:3] and kv.allocator.evicted == 1
    assert not kv.can_admit(2, 8, cached)
    with pytest.raises(KVOutOfMemory):
        kv.allocate(2, 8, cached)
    assert 2 not in kv.tables and kv.allocator.num_cached == 3    # a failed allocation takes nothing
    kv.free(other.request_id)


def test_eviction_trims_chains_from_their_leaves():
    kv = KVCacheManager(6, 1, prefix_caching=True)
    _prefill(kv, _req(1, [1, 2, 3, 4]))
    kv.free(1)
    kv.allocate(2, 2)                      # the 2 free blocks
    kv.allocate(3, 2)                      # evicts 2 of the 4 cached ones
    names = chain_hashes([1, 2, 3, 4], 1, chain_root())
    held = len(kv.allocator.lookup(names))
    assert held == 2                       # the two leaves went first, the head survives
    assert kv.allocator.name_of(kv.allocator.lookup(names)[0]) == names[0]


def test_shared_blocks_outlive_one_holder():
    kv = KVCacheManager(8, 2, prefix_caching=True)
    _prefill(kv, _req(1, [1, 2, 3, 4, 5]))
    assert _prefill(kv, _req(2, [1, 2, 3, 4, 6])) == 4
    shared = kv.table(1)[:2]
    assert kv.table(2)[:2] == shared and all(kv.allocator.refcount(b) == 2 for b in shared)
    kv.free(1)
    assert all(kv.allocator.refcount(b) == 1 for b in shared) and kv.allocator.num_cached == 0
    kv.free(2)
    assert kv.allocator.num_cached == 2 and kv.num_free_blocks == 8
    with pytest.raises(ValueError, match="freed twice"):
        kv.allocator.free(shared)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(8, 4)
    kv.allocate(1, 10)
    copy = kv.fork(1, 2, 10)
    assert kv.table(2)[:2] == kv.table(1)[:2] and kv.table(2)[2] != kv.table(1)[2]
    assert copy.src_blocks == (kv.table(1)[2],) and copy.dst_blocks == (kv.table(2)[2],) and copy.num_tokens == 2
    assert kv.fork(1, 3, 8) is None and kv.table(3) == kv.table(1)[:2]
    assert kv.allocator.num_used == 4
    with pytest.raises(ValueError):
        kv.fork(1, 2, 4)                   # the child holds blocks already
    for rid in (1, 2, 3):
        kv.free(rid)
    assert kv.num_free_blocks == 8
    kv.allocator.check()


def test_a_block_name_has_one_holder():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.name(a, "x") and not pool.name(b, "x") and not pool.name(a, "y")
    pool.free([a, b])
    assert pool.num_cached == 1 and pool.lookup(["x"]) == [a]
    with pytest.raises(ValueError, match="free"):
        pool.ref([b])                      # a free block holds nothing to share
    pool.check()


# ---- property test: random sessions ------------------------------------------------------------
BLOCK = 2


class KVSessions(RuleBasedStateMachine):
    """Random allocate / grow / free / fork / match / evict over a small pool with a two-token
    alphabet (many equal blocks after different prefixes). A model records what each block holds;
    every matched block must hold exactly the tokens the new request would have computed there,
    and no request ever writes into a block it shares."""

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.kv = KVCacheManager(num_blocks, BLOCK, prefix_caching=True)
        self.reqs: dict[int, Request] = {}
        self.content: dict[int, list[int]] = {}      # block -> tokens written there
        self.next_id = 0

    def _tokens(self, req: Request) -> list[int]:
        return req.prompt_token_ids + (req.output_token_ids or [])

    def _write(self, req: Request, start: int, end: int) -> None:
        table, tokens = self.kv.table(req.request_id), self._tokens(req)
        for pos in range(start, end):
            block = table[pos // BLOCK]
            assert self.kv.allocator.refcount(block) == 1, "a request wrote into a shared block"
            held = self.content.setdefault(block, [])
            del held[pos % BLOCK:]
            held.append(tokens[pos])

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def new_request(self, prompt):
        rid, self.next_id = self.next_id, self.next_id + 1
        req = _req(rid, prompt)
        cached = self.kv.match(req)
        for i, block in enumerate(cached):       # the hash chain never confuses two prefixes
            assert self.content[block] == prompt[i * BLOCK:(i + 1) * BLOCK]
        assert len(cached) * BLOCK < len(prompt)
        if not self.kv.can_admit(rid, len(prompt), cached):
            with pytest.raises(KVOutOfMemory):
                self.kv.allocate(rid, len(prompt), cached)
            assert rid not in self.kv.tables
            return
        self.kv.allocate(rid, len(prompt), cached)
        for block in self.kv.table(rid)[len(cached):]:
            self.content.pop(block, None)            # fresh (possibly evicted) blocks hold nothing yet
        self._write(req, len(cached) * BLOCK, len(prompt))
        req.num_computed_tokens = len(prompt)
        self.kv.register(req)
        self.reqs[rid] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, 1))
    def grow(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        if not self.kv.can_grow(rid, req.num_computed_tokens + 1):
            return
        before = self.kv.num_allocated(rid)
        new = self.kv.allocate(rid, req.num_computed_tokens + 1)
        assert len(new) == self.kv.num_allocated(rid) - before
        for block in new:
            self.content.pop(block, None)
        req.output_token_ids = (req.output_token_ids or []) + [token]
        self._write(req, req.num_computed_tokens, req.num_computed_tokens + 1)
        req.num_computed_tokens += 1
        self.kv.register(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        held = self.kv.num_allocated(rid)
        assert self.kv.free(rid) == held
        del self.reqs[rid]
        assert self.kv.free(rid) == 0

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        n = parent.num_computed_tokens
        if n % BLOCK and self.kv.num_free_blocks < 1:
            with pytest.raises(KVOutOfMemory):
                self.kv.fork(parent.request_id, self.next_id, n)
            return
        rid, self.next_id = self.next_id, self.next_id + 1
        copy = self.kv.fork(parent.request_id, rid, n)
        if copy is not None:
            self.content[copy.dst_blocks[0]] = list(self.content[copy.src_blocks[0]])
        child = _req(rid, parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids or [])
        child.num_computed_tokens = n
        self.kv.register(child)
        self.reqs[rid] = child

    @rule(n=st.integers(1, 6))
    def pressure(self, n):
        """An outside allocation that may evict cached blocks, released straight away."""
        if n <= self.kv.num_free_blocks:
            for block in self.kv.allocate(-1, n * BLOCK):
                self.content.pop(block, None)
            self.kv.free(-1)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.allocator
        pool.check()
        holders: dict[int, int] = {}
        for table in self.kv.tables.values():
            assert len(set(table)) == len(table)
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        assert all(pool.refcount(b) == holders.get(b, 0) for b in range(pool.num_blocks))
        assert pool.num_used == len(holders)
        for rid, req in self.reqs.items():       # every named block holds what its name says
            for i, block in enumerate(self.kv.table(rid)[:req.num_computed_tokens // BLOCK]):
                assert self.content[block] == self._tokens(req)[i * BLOCK:(i + 1) * BLOCK]


TestKVSessions = KVSessions.TestCase
TestKVSessions.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


# ---- the simulator's prefix cache on the same pool -----------------------------------------------
class _LRUReference:
    """The simulator's prefix cache before it moved onto BlockPool (an OrderedDict LRU over token
    capacity): the pool-backed PrefixCache must hold the same blocks in the same order."""

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict
        self.capacity, self.held, self.used, self.evicted = capacity, OrderedDict(), 0, 0

    def match(self, blocks, touch=False):
        k = 0
        while k < len(blocks) and blocks[k][0] in self.held:
            k += 1
        if touch:
            for name, _ in reversed(blocks[:k]):
                self.held.move_to_end(name)
        return sum(n for _, n in blocks[:k])

    def insert(self, blocks):
        for name, n in reversed(blocks):
            if name in self.held:
                self.held.move_to_end(name)
            else:
                self.held[name] = n
                self.used += n
        while self.used > self.capacity and self.held:
            _, n = self.held.popitem(last=False)
            self.used -= n
            self.evicted += n


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 12), ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "touch"]),
                                                           st.integers(0, 3), st.integers(0, 8)), max_size=40))
def test_prefix_cache_on_the_pool_is_the_lru_it_replaced(capacity, ops):
    from laneserve.core.prefix_cache import PrefixCache
    bt = 64
    cache, ref = PrefixCache(capacity * bt), _LRUReference(capacity * bt)
    for op, session, length in ops:            # chains of a few sessions, prefixes of each other
        chain = tuple(((session, i), bt) for i in range(length))
        if op == "insert":
            cache.insert(chain)
            ref.insert(chain)
        else:
            assert cache.match(chain, touch=op == "touch") == ref.match(chain, touch=op == "touch")
        assert cache.used_tokens == ref.used and cache.evicted_tokens == ref.evicted
        assert [cache._pool.name_of(b) for b in cache._pool.cached_blocks()] == list(ref.held)
        cache._pool.check()


def test_a_bad_release_changes_nothing():
    pool = BlockPool(6)
    a, b = pool.allocate(3), pool.allocate(1)
    pool.ref(a[:1])                                   # a[0] has two holders
    unheld = next(x for x in range(6) if pool.refcount(x) == 0)
    state = [pool.refcount(x) for x in range(6)], pool.num_free
    for bad in ([b[0], b[0]], [a[1], unheld], [a[1], a[2], a[2]], [a[2], a[0], a[1], a[1]]):
        with pytest.raises(ValueError, match="freed twice"):
            pool.free(bad)
        assert ([pool.refcount(x) for x in range(6)], pool.num_free) == state
        pool.check()
    pool.free(a)
    assert [pool.refcount(x) for x in a] == [1, 0, 0] and pool.num_free == 4
    pool.check()


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "append", "free"]), st.integers(0, 5), st.integers(1, 90)),
                    max_size=60))
def test_an_exclusive_manager_hands_out_the_blocks_a_counting_one_would(ops):
    """The simulator's managers keep no reference counts: every table, free count and
    out-of-memory refusal must be what the reference-counted pool gives."""
    counted, exclusive = KVCacheManager(24, 4), KVCacheManager(24, 4, exclusive=True)
    assert isinstance(exclusive.allocator, ExclusiveBlockPool)
    for op, rid, tokens in ops:
        results = []
        for kv in (counted, exclusive):
            try:
                if op == "grow":
                    results.append(kv.allocate(rid, kv.num_allocated(rid) * 4 + tokens))
                elif op == "append":
                    holders = sorted(r for r in kv.tables if kv.tables[r])
                    kv.append_blocks(holders[:tokens % 3 + 1])
                    results.append(holders)
                else:
                    results.append(kv.free(rid))
            except KVOutOfMemory:
                results.append("oom")
        assert results[0] == results[1]
        assert counted.tables == exclusive.tables
        assert counted.num_free_blocks == exclusive.num_free_blocks and counted.usage == exclusive.usage
        exclusive.allocator.check()
    for b in range(24):
        assert exclusive.allocator.refcount(b) == counted.allocator.refcount(b)


def test_an_exclusive_pool_refuses_sharing_and_an_over_release():
    pool = ExclusiveBlockPool(4)
    a = pool.allocate(3)
    with pytest.raises(ValueError, match="shares no blocks"):
        pool.ref(a[:1])
    with pytest.raises(ValueError, match="names no blocks"):
        pool.name(a[0], "x")
    pool.forget(a[0])                                 # nothing named: nothing changes
    assert pool.num_free == 1 and pool.refcount(a[0]) == 1
    pool.free(a)
    with pytest.raises(ValueError, match="double or foreign free"):
        pool.free(a[:1])
    assert pool.num_free == 4
    pool.check()
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, 4, prefix_caching=True, exclusive=True)
    kv = KVCacheManager(8, 4, exclusive=True)
    kv.allocate(1, 6)
    with pytest.raises(ValueError, match="shares no blocks"):
        kv.fork(1, 2, 6)
    assert 2 not in kv.tables and kv.num_free_blocks == 6
