"""KV block accounting, pure Python (docs/design.md, "The central contract"): per-request block
tables over a reference-counted block pool (``block_pool.py``: prefix caching, fork), a host-memory
pool tier, and the swap / transfer plans the engine executes on tensors. A double free or a foreign free raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from laneserve.core.block_pool import BlockPool, ExclusiveBlockPool, KVOutOfMemory, chain_hashes, chain_root

if TYPE_CHECKING:
    from laneserve.core.request import Request

__all__ = ["BlockCopy", "BlockPool", "HostKVPool", "KVCacheManager", "KVOutOfMemory", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVCacheManager:
    """Per-request block tables over one :class:`~laneserve.core.block_pool.BlockPool` (one
    instance's device KV, or a host pool).

    ``watermark_blocks`` are kept free for running requests to grow into: new admissions
    (:meth:`can_admit`) must leave them free, growth (:meth:`can_grow`) may use them. Cached blocks
    (prefix caching: named, held by no request) count as free everywhere.

    With ``prefix_caching`` the full blocks of a request's tokens are named by their hash chain
    (:func:`~laneserve.core.block_pool.chain_hashes` from ``cache_key``) as :meth:`register` sees
    them computed, stay cached after :meth:`free`, and :meth:`match` finds them for a later
    request with the same leading tokens, which then starts with those blocks in its table
    (``allocate(..., cached=blocks)``) and computes only the rest.
    """

    __slots__ = ("block_size", "allocator", "tables", "watermark_blocks", "prefix_caching", "_root",
                 "_hashes", "query_tokens", "hit_tokens")

    def __init__(self, num_blocks: int, block_size: int = 16, watermark: float = 0.0, *,
                 prefix_caching: bool = False, cache_key: bytes = b"", exclusive: bool = False) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if exclusive and prefix_caching:
            raise ValueError("prefix caching shares blocks: it needs a non-exclusive KV manager")
        self.block_size = block_size
        self.allocator = ExclusiveBlockPool(num_blocks) if exclusive else BlockPool(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.watermark_blocks = int(num_blocks * watermark)
        self.prefix_caching = prefix_caching
        self._root = chain_root(cache_key)
        self._hashes: dict[int, list[bytes]] = {}     # rid -> names of its table's leading full blocks
        self.query_tokens = 0        # prompt tokens of the requests looked up (vLLM's prefix cache queries)
        self.hit_tokens = 0          # of which found cached

    # ---- queries -------------------------------------------------------------------------
    @property
    def root(self) -> bytes:
        """The digest every hash chain of this manager starts from (its ``cache_key``'s)."""
        return self._root

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        n = self.allocator.num_blocks
        return self.allocator.num_used / n if n else 0.0

    def num_allocated(self, request_id: int) -> int:
        table = self.tables.get(request_id)
        return len(table) if table else 0

    def blocks_needed(self, request_id: int, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Available blocks that growing ``request_id`` to ``num_tokens`` tokens uses up (starting
        a new request on ``cached`` blocks takes the cached ones among them off the evictable set)."""
        table = self.tables.get(request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if cached:
            need += self.allocator.num_reclaimed(cached) - len(cached)
        return need if need > 0 else 0

    def can_admit(self, request_id: int, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.blocks_needed(request_id, num_tokens, cached) <= self.allocator.num_free - self.watermark_blocks

    def can_grow(self, request_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.allocator.num_free

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit at all, even in an empty cache."""
        return blocks_for(num_tokens, self.block_size) <= self.allocator.num_blocks - self.watermark_blocks

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, request_id: int, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; returns the new blocks.
        ``cached`` (from :meth:`match`, for a request holding nothing yet) starts the table with
        those shared blocks. Raises :class:`KVOutOfMemory` (allocating nothing) when they do not fit."""
        if cached:
            if request_id in self.tables:
                raise ValueError(f"request {request_id} already holds blocks: cached blocks start a table")
            if self.blocks_needed(request_id, num_tokens, cached) > self.allocator.num_free:
                raise KVOutOfMemory(f"need {self.blocks_needed(request_id, num_tokens, cached)} blocks, "
                                    f"{self.allocator.num_free} free of {self.num_blocks}")
            self.allocator.ref(cached)               # first: the allocation below must not evict them
            self.tables[request_id] = list(cached)
            self._hashes[request_id] = [self.allocator.name_of(b) for b in cached]  # type: ignore[misc]
        need = self.blocks_needed(request_id, num_tokens)
        if need == 0:
            return []
        new = self.allocator.allocate(need)
        table = self.tables.get(request_id)
        if table is None:
            self.tables[request_id] = new
            return list(new)
        table.extend(new)
        return new

    def append_blocks(self, request_ids: list[int]) -> None:
        """One more block for each of ``request_ids`` (each holding blocks already), in turn: the
        blocks as many one-block :meth:`allocate` calls would give, in one allocation."""
        tables = self.tables
        for rid, block in zip(request_ids, reversed(self.allocator.allocate(len(request_ids)))):
            tables[rid].append(block)

    def free(self, request_id: int) -> int:
        """Release every block of ``request_id``; returns how many (0 if it held none). With
        prefix caching its named blocks stay cached until an allocation needs them."""
        if self.prefix_caching:
            self._hashes.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        if not table:
            return 0
        self.allocator.free(table)
        return len(table)

    def table(self, request_id: int) -> list[int]:
        return self.tables.get(request_id, [])

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> BlockCopy | None:
        """Give ``child_id`` the first ``num_tokens`` tokens of ``parent_id``'s KV: the full blocks
        are shared (reference counted), a partial last block gets a fresh block for the child.
        Returns the copy the engine performs for that partial block (None when there is none)."""
        table = self.tables.get(parent_id)
        if table is None:
            raise KeyError(f"request {parent_id} holds no blocks")
        if child_id in self.tables:
            raise ValueError(f"request {child_id} already holds blocks")
        bs = self.block_size
        if not 0 < num_tokens <= len(table) * bs:
            raise ValueError(f"fork of {num_tokens} tokens from a table of {len(table)} blocks")
        full, partial = divmod(num_tokens, bs)
        if partial and self.allocator.num_free < 1:
            raise KVOutOfMemory(f"fork of request {parent_id} needs 1 block, none free")
        shared = table[:full]
        self.allocator.ref(shared)
        child = list(shared)
        copy = None
        if partial:
            new = self.allocator.allocate(1)
            copy = BlockCopy(child_id, partial, (table[full],), tuple(new))
            child.extend(new)
        self.tables[child_id] = child
        named = self._hashes.get(parent_id)
        if named:
            self._hashes[child_id] = named[:full]
        return copy

    # ---- prefix caching ------------------------------------------------------------------
    def prompt_hashes(self, req: Request) -> list[bytes]:
        """Names of ``req``'s full prompt blocks under this manager's chain."""
        return prompt_block_hashes(req, self.block_size, self._root)

    def match(self, req: Request, num_tokens: int | None = None) -> list[int]:
        """The cached blocks holding ``req``'s leading tokens (prompt, then outputs), leaving at
        least one of its first ``num_tokens`` tokens (default: the prompt) to compute, so that the
        step computing the rest yields logits. Empty without prefix caching or token ids."""
        if not self.prefix_caching or req.prompt_token_ids is None:
            return []
        if req.sampling is not None and req.sampling.prompt_logprobs is not None:
            return []                    # every prompt position's logits are wanted
        n = req.prompt_len if num_tokens is None else num_tokens
        limit = (n - 1) // self.block_size
        if limit <= 0:
            return []
        names = self.prompt_hashes(req)
        if limit > len(names):           # a recompute: the prompt and some outputs
            tokens = _tokens(req, n)
            names = names + chain_hashes(tokens, self.block_size, names[-1] if names else self._root,
                                         start_block=len(names), num_blocks=limit - len(names))
        return self.allocator.lookup(names[:limit])

    def record_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (``hit_tokens`` of its ``prompt_tokens`` reused)."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def register(self, req: Request) -> int:
        """Name the full blocks of ``req``'s computed tokens that are not named yet (after a step;
        a no-op without prefix caching). Returns how many new names were tried."""
        if not self.prefix_caching or req.prompt_token_ids is None:
            return 0
        rid = req.request_id
        table = self.tables.get(rid)
        if not table:
            return 0
        bs = self.block_size
        full = min(req.num_computed_tokens // bs, len(table))
        names = self._hashes.setdefault(rid, [])
        done = len(names)
        if full <= done:
            return 0
        prompt_names = self.prompt_hashes(req)
        if done < len(prompt_names):
            names.extend(prompt_names[done:full])
        if len(names) < full:
            tokens = _tokens(req, full * bs)
            names.extend(chain_hashes(tokens, bs, names[-1] if names else self._root,
                                      start_block=len(names), num_blocks=full - len(names)))
        name = self.allocator.name
        for i in range(done, full):
            name(table[i], names[i])
        return full - done

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0




def prompt_block_hashes(req: Request, block_size: int, root: bytes) -> list[bytes]:
    """Names of ``req``'s full prompt blocks under the chain from ``root``, memoised on the request
    (routers and policies ask about every request often; an instance's KV manager and the router's
    summary of it use the same chain, so they share the memo)."""
    key = (root, block_size)
    memo = req.policy_state.block_hashes
    if memo is None or memo[0] != key:
        memo = req.policy_state.block_hashes = (key, chain_hashes(req.prompt_token_ids or (), block_size, root))
    return memo[1]


def _tokens(req: Request, n: int) -> list[int]:
    """The first ``n`` of ``req``'s prompt + output tokens."""
    prompt = req.prompt_token_ids or []
    if n <= len(prompt):
        return list(prompt[:n])
    return list(prompt) + list(req.output_token_ids or [])[:n - len(prompt)]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy of one request's KV between tiers or instances: ``src[i] -> dst[i]``."""

    request_id: int
    num_tokens: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class HostKVPool(KVCacheManager):
    """The host-memory tier: a KV manager whose blocks live in CPU memory. Swapping moves a
    request's table between a device manager and the pool and returns the copy to perform."""

    def swap_out(self, device: KVCacheManager, request_id: int, num_tokens: int) -> BlockCopy:
        src = tuple(device.table(request_id))
        dst = tuple(self.allocate(request_id, num_tokens))
        device.free(request_id)
        return BlockCopy(request_id, num_tokens, src, dst)

    def swap_in(self, device: KVCacheManager, request_id: int, num_tokens: int) -> BlockCopy:
        dst = tuple(device.allocate(request_id, num_tokens))
        src = tuple(self.table(request_id))
        self.free(request_id)
        return BlockCopy(request_id, num_tokens, src, dst)
