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

Pure Python: no torch. The simulator gives each prefill instance one (``ClusterConfig.
prefix_cache_tokens``); routers read it through ``cached_prefix`` on the instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

#: tokens per named block of a session's history (a multiple of the engine's 16-token KV pages)
SESSION_BLOCK_TOKENS = 64
#: tokens per ``hash_ids`` entry (Mooncake traces name 512-token blocks)
HASH_BLOCK_TOKENS = 512
_TAG = "prefix_blocks"

Block = tuple[Hashable, int]          # (content name, tokens)


def prefix_blocks(req, *, block_tokens: int = SESSION_BLOCK_TOKENS,
                  hash_block_tokens: int = HASH_BLOCK_TOKENS) -> tuple[Block, ...]:
    """The named full blocks of ``req``'s prompt, in order (memoised in ``req.tags`` when the
    request has tags). ``req`` is a :class:`~laneserve.core.request.Request` or a ``RequestSpec``."""
    tags = getattr(req, "tags", None)
    if tags is not None and _TAG in tags:
        return tags[_TAG]
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
    if tags is not None:
        tags[_TAG] = blocks
    return blocks


class PrefixCache:
    """Named KV blocks held by one instance, least recently used first, at most ``capacity_tokens``."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = int(capacity_tokens)
        self._blocks: OrderedDict[Hashable, int] = OrderedDict()
        self.used_tokens = 0
        self.evicted_tokens = 0
        self.lookups = 0
        self.lookup_tokens = 0          # prompt tokens of the requests looked up (touching lookups)
        self.hit_tokens = 0             # of which found cached
        self.version = 0                # bumped whenever the held set changes (memo key for lookups)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._blocks

    def match(self, blocks: Sequence[Block], *, touch: bool = False) -> int:
        """Tokens of the longest run of leading ``blocks`` held here. ``touch`` marks them used (a
        request about to run on them) and counts the lookup in the hit statistics."""
        held = self._blocks
        k, tokens = 0, 0
        for name, n in blocks:
            if name not in held:
                break
            k += 1
            tokens += n
        if touch:
            for name, _ in reversed(blocks[:k]):
                held.move_to_end(name)
        return tokens

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (``hit_tokens`` of its ``prompt_tokens`` reused)."""
        self.lookups += 1
        self.lookup_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def insert(self, blocks: Sequence[Block]) -> None:
        """Hold ``blocks`` (a prompt just prefilled here), then evict least recently used blocks
        until the capacity holds. The chain is touched tail first, so its head is the most recent."""
        held = self._blocks
        self.version += 1
        for name, n in reversed(blocks):
            if name in held:
                held.move_to_end(name)
            else:
                held[name] = n
                self.used_tokens += n
        while self.used_tokens > self.capacity_tokens and held:
            _, n = held.popitem(last=False)
            self.used_tokens -= n
            self.evicted_tokens += n

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens over the admitted requests looked up (0 if none)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def stats(self) -> dict[str, float]:
        return {"prefix_cache_tokens": self.used_tokens, "prefix_cache_capacity": self.capacity_tokens,
                "prefix_hit_rate": self.hit_rate, "prefix_evicted_tokens": self.evicted_tokens,
                "prefix_lookups": self.lookups}
