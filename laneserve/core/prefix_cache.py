"""A prefill instance's prefix cache: which prompt KV it still holds, by content block, so that a
request routed to it computes only what is not there (multi-turn history, shared system prompts).

The model is a radix cache at block granularity (the scheme of SGLang's RadixAttention and vLLM's
automatic prefix caching): a prompt is a chain of full blocks, each named by its content; a
request's cached prefix is the longest run of its leading blocks that the instance holds; after a
prefill the instance holds the prompt's full blocks; when over capacity it evicts the least
recently used block, and a chain's later blocks are always less recent than its earlier ones
(touched tail first), so eviction trims chains from their ends as a radix tree evicts leaves.

Block names come from the workload (:func:`prefix_blocks`): Mooncake-style ``hash_ids`` (one id per
``hash_block_tokens`` tokens; equal ids mean equal content), else a multi-turn session's position
(``(session, block index)``: a session's history only grows, so block ``i`` of a session has the
same content in every turn that covers it). A request with neither shares nothing. Only full
blocks are named: a prompt's partial last block is recomputed next time, as on a paged cache.

The blocks are kept by the engine's :class:`~laneserve.core.block_pool.BlockPool` (named by the
workload's names instead of token hashes), so the simulator and the engine evict alike.

Pure Python: no torch. The simulator gives each prefill instance one (``ClusterConfig.
prefix_cache_tokens``); routers read it through ``cached_prefix`` on the instance.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from laneserve.core.block_pool import BlockPool

#: tokens per named block of a session's history (a multiple of the engine's 16-token KV pages)
SESSION_BLOCK_TOKENS = 64
#: tokens per ``hash_ids`` entry (Mooncake traces name 512-token blocks)
HASH_BLOCK_TOKENS = 512

Block = tuple[Hashable, int]          # (content name, tokens)


def prefix_blocks(req, *, block_tokens: int = SESSION_BLOCK_TOKENS,
                  hash_block_tokens: int = HASH_BLOCK_TOKENS) -> tuple[Block, ...]:
    """The named full blocks of ``req``'s prompt, in order (memoised in ``req.policy_state`` when
    ``req`` is a :class:`~laneserve.core.request.Request`; a ``RequestSpec`` has none)."""
    state = getattr(req, "policy_state", None)
    if state is not None and state.prefix_blocks is not None:
        return state.prefix_blocks
    n = req.prompt_len
    hash_ids = getattr(req, "hash_ids", None)
    if hash_ids:
        full = min(len(hash_ids), n // hash_block_tokens)
        blocks = tuple((("h", h), hash_block_tokens) for h in hash_ids[:full])
    elif getattr(req, "session_id", None) is not None:
        sid = req.session_id
        blocks = tuple((("s", sid, i), block_tokens) for i in range(n // block_tokens))
    else:
        blocks = ()
    if state is not None:
        state.prefix_blocks = blocks
    return blocks


class PrefixCache:
    """Named KV blocks held by one instance, least recently used first, at most ``capacity_tokens``.

    The blocks live in a :class:`~laneserve.core.block_pool.BlockPool`, the engine's block pool, named
    by the workload's block names instead of token hashes: between calls every block is cached
    (refcount 0); :meth:`match` with ``touch`` and :meth:`insert` hold the chain's blocks for a moment
    and release them tail first, so the chain's head is the most recent and eviction (the pool's,
    when an insert needs a block) trims chains from their leaves. The pool's block is the first
    inserted block's size (one size per cache: a workload names 64-token session blocks or 512-token
    ``hash_ids`` blocks).
    """

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = int(capacity_tokens)
        self.block_tokens: int | None = None          # set by the first insert
        self._pool = BlockPool(0)
        self.evicted_tokens = 0
        self.lookups = 0
        self.lookup_tokens = 0          # prompt tokens of the requests looked up (touching lookups)
        self.hit_tokens = 0             # of which found cached
        self.version = 0                # bumped whenever the held set changes (memo key for lookups)

    def __len__(self) -> int:
        return self._pool.num_named

    def __contains__(self, name: Hashable) -> bool:
        return bool(self._pool.lookup((name,)))

    @property
    def used_tokens(self) -> int:
        return self._pool.num_named * (self.block_tokens or 0)

    def match(self, blocks: Sequence[Block], *, touch: bool = False) -> int:
        """Tokens of the longest run of leading ``blocks`` held here. ``touch`` marks them used (a
        request about to run on them) and counts the lookup in the hit statistics."""
        held = self._pool.lookup(name for name, _ in blocks)
        if touch and held:
            self._pool.ref(held)
            self._pool.free(held)                     # tail first: the head is the most recent
        return sum(n for _, n in blocks[:len(held)])

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (``hit_tokens`` of its ``prompt_tokens`` reused)."""
        self.lookups += 1
        self.lookup_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def insert(self, blocks: Sequence[Block]) -> None:
        """Hold ``blocks`` (a prompt just prefilled here), evicting least recently used blocks when
        the capacity is reached; the chain ends up the most recent, its head first. A chain longer
        than the capacity keeps its head (its tail is counted as evicted)."""
        if not blocks:
            return
        self.version += 1
        pool = self._pool
        if self.block_tokens is None:
            self.block_tokens = blocks[0][1]
            pool = self._pool = BlockPool(self.capacity_tokens // self.block_tokens)
        if any(n != self.block_tokens for _, n in blocks):
            raise ValueError(f"prefix cache of {self.block_tokens}-token blocks given blocks of "
                             f"{sorted({n for _, n in blocks})} tokens")
        keep = blocks[:pool.num_blocks]
        for name, n in blocks[pool.num_blocks:]:      # beyond the whole capacity: gone at once
            held = pool.lookup((name,))
            if held:                                  # a stale copy would outlive its head: drop it
                pool.ref(held)
                pool.forget(held[0])
                pool.free(held)
            self.evicted_tokens += n
        chain: list[int | None] = [(pool.lookup((name,)) or [None])[0] for name, _ in keep]
        pool.ref([b for b in chain if b is not None])     # held: the allocations below cannot evict them
        before = pool.evicted
        for i in range(len(keep) - 1, -1, -1):
            if chain[i] is None:
                (b,) = pool.allocate(1)
                pool.name(b, keep[i][0])
                chain[i] = b
        self.evicted_tokens += (pool.evicted - before) * self.block_tokens
        pool.free(chain)                              # tail first: the head is the most recent

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens over the admitted requests looked up (0 if none)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def stats(self) -> dict[str, float]:
        return {"prefix_cache_tokens": self.used_tokens, "prefix_cache_capacity": self.capacity_tokens,
                "prefix_hit_rate": self.hit_rate, "prefix_evicted_tokens": self.evicted_tokens,
                "prefix_lookups": self.lookups}
