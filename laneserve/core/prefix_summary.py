"""What a remote instance's prefix cache holds, as the router sees it (live cache-aware routing).

An engine instance's :class:`~laneserve.core.block_pool.BlockPool` logs the names (hash-chain
digests) it adds and drops (:meth:`~laneserve.core.block_pool.BlockPool.record_events`); the
instance sends them with its stats, in order, and the router applies them here. The summary is
the set of names the instance holds (used or cached), so a request's cached prefix on that
instance is the run of its leading block names found in the set: the same answer the instance's
own ``KVCacheManager.match`` gives, up to the events still in flight (at most one stats interval
behind; a stale answer costs only a routing choice, never correctness).

The router names a request's blocks with the instance's chain root and block size (sent in its
``ready`` info), memoised on the request, so one request routed across N instances of the same
model hashes its prompt once. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from laneserve.core.block_pool import STORED
from laneserve.core.kv import prompt_block_hashes
from laneserve.core.request import Request



class PrefixSummary:
    """The block names one instance holds, kept from its events."""

    __slots__ = ("block_size", "root", "names")

    def __init__(self, block_size: int, root: bytes) -> None:
        """``root``: the instance's chain root (``KVCacheManager.root``, from its ready info)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.root = root
        self.names: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self.names)

    def apply(self, events: Iterable[tuple[int, Hashable]]) -> None:
        """Apply ``(STORED | REMOVED, name)`` events in the order the instance logged them."""
        names = self.names
        for kind, name in events:
            if kind == STORED:
                names.add(name)
            else:
                names.discard(name)

    def clear(self) -> None:
        """Forget everything (the instance restarted with an empty cache)."""
        self.names.clear()

    def cached_tokens(self, req: Request) -> int:
        """Prompt tokens of ``req`` the instance would not compute if it started it now: its leading
        held blocks, leaving at least one token to compute (as ``KVCacheManager.match`` does)."""
        if not self.names or not req.prompt_token_ids:
            return 0
        limit = (req.prompt_len - 1) // self.block_size
        names, held = prompt_block_hashes(req, self.block_size, self.root), self.names
        k = 0
        for name in names[:limit]:
            if name not in held:
                break
            k += 1
        return k * self.block_size
