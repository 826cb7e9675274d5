"""KV block accounting, pure Python (DESIGN.md): block allocators with free lists, per-request
block tables, a host-memory pool tier, and the swap / transfer plans the engine executes on
tensors. Every block is owned by at most one request; a double free or a foreign free raises.
"""

from __future__ import annotations

from dataclasses import dataclass


class KVOutOfMemory(RuntimeError):
    """Raised when an allocation is attempted without enough free blocks."""


class BlockAllocator:
    """A pool of ``num_blocks`` fixed-size blocks with a LIFO free list."""

    __slots__ = ("num_blocks", "_free", "_in_use")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVOutOfMemory(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        if n <= 0:
            return []
        free = self._free
        blocks = free[-n:]
        del free[-n:]
        in_use = self._in_use
        for b in blocks:
            in_use[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        in_use = self._in_use
        for b in blocks:
            if not in_use[b]:
                raise ValueError(f"block {b} freed twice or never allocated")
            in_use[b] = 0
        self._free.extend(blocks)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVCacheManager:
    """Per-request block tables over one allocator (one instance's device KV, or a host pool).

    ``watermark_blocks`` are kept free for running requests to grow into: new admissions
    (:meth:`can_admit`) must leave them free, growth (:meth:`can_grow`) may use them.
    """

    __slots__ = ("block_size", "allocator", "tables", "watermark_blocks")

    def __init__(self, num_blocks: int, block_size: int = 16, watermark: float = 0.0) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.watermark_blocks = int(num_blocks * watermark)

    # ---- queries -------------------------------------------------------------------------
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

    def blocks_needed(self, request_id: int, num_tokens: int) -> int:
        """Extra blocks needed for ``request_id`` to hold ``num_tokens`` tokens in total."""
        need = -(-num_tokens // self.block_size) - self.num_allocated(request_id)
        return need if need > 0 else 0

    def can_admit(self, request_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.allocator.num_free - self.watermark_blocks

    def can_grow(self, request_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.allocator.num_free

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit at all, even in an empty cache."""
        return blocks_for(num_tokens, self.block_size) <= self.allocator.num_blocks - self.watermark_blocks

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; returns the new blocks.
        Raises :class:`KVOutOfMemory` (allocating nothing) when they do not fit."""
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
        """Release every block of ``request_id``; returns how many (0 if it held none)."""
        table = self.tables.pop(request_id, None)
        if not table:
            return 0
        self.allocator.free(table)
        return len(table)

    def table(self, request_id: int) -> list[int]:
        return self.tables.get(request_id, [])


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
