"""Paged KV tensors addressed by the core's block tables (docs/design.md, "The central contract": block
accounting is pure Python in ``laneserve.core.kv``; tensors live only in the engine).

One tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` per tier, so that a block
copy between tiers (device <-> host pool, AlignedServe §3) or an export for prefill -> decode
transfer moves every layer in one indexing operation. Layer ``l``'s K cache is the contiguous view
``data[l, 0]`` (``[num_blocks, block_size, kv_heads, head_dim]``).

``scratch_blocks`` extra blocks after the ``num_blocks`` the core's ``KVCacheManager`` hands out
are owned by no request: the shape-bucket runner (``engine/graphs.py``) points the K/V writes and
context gathers of its padding rows there, so padding never touches a request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laneserve.core.kv import BlockCopy, KVCacheManager
from laneserve.engine.config import EngineConfig


def make_kv_manager(num_blocks: int, config: EngineConfig, *, role: str, model_id: str) -> KVCacheManager:
    """The block accounting of one engine instance. Prefix caching (``config.prefix_caching``) is on
    for prefill and colocated instances, whose requests start from prompts; a decode instance takes
    each prompt's KV whole from a prefill instance and keeps none across requests. The hash chain is
    rooted in the model and dtype, the inputs besides the tokens that decide the KV."""
    return KVCacheManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching and role != "decode",
                          cache_key=f"{model_id}|{config.dtype}".encode())


@dataclass(slots=True)
class KVPayload:
    """A request's KV as a CPU tensor bundle, independent of block size (prefill -> decode transfer).

    ``kv``: ``[layers, 2, num_tokens, kv_heads, head_dim]`` (index 0 = K, 1 = V)."""

    num_tokens: int
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PagedKVCache:
    __slots__ = ("data", "block_size", "num_blocks", "scratch_blocks", "num_layers", "num_kv_heads", "head_dim")

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
                 scratch_blocks: int = 0) -> None:
        if scratch_blocks < 0:
            raise ValueError("scratch_blocks must be >= 0")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.scratch_blocks = scratch_blocks
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_layers, 2, num_blocks + scratch_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def scratch_block(self) -> int:
        """Index of the first scratch block (right after the managed ones)."""
        if not self.scratch_blocks:
            raise ValueError("this KV cache has no scratch block")
        return self.num_blocks

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches flattened to ``[(num_blocks + scratch_blocks) * block_size,
        kv_heads, head_dim]``."""
        kv = self.data[layer]
        flat = ((self.num_blocks + self.scratch_blocks) * self.block_size, self.num_kv_heads, self.head_dim)
        return kv[0].view(flat), kv[1].view(flat)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new ``k``/``v`` ``[T, kv_heads, head_dim]`` at flat cache ``slots`` ``[T]``."""
        k_cache, v_cache = self.layer(layer)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    # ---- block copies --------------------------------------------------------------------
    def copy_blocks(self, dst: PagedKVCache, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Copy blocks ``src_blocks`` of this cache into ``dst_blocks`` of ``dst`` (same geometry;
        any devices)."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"block copy of {len(src_blocks)} blocks into {len(dst_blocks)}")
        if not src_blocks:
            return
        self._check_geometry(dst)
        src_idx = torch.tensor(src_blocks, dtype=torch.long, device=self.device)
        dst_idx = torch.tensor(dst_blocks, dtype=torch.long, device=dst.device)
        moved = self.data.index_select(2, src_idx).to(dst.device, non_blocking=True)
        dst.data.index_copy_(2, dst_idx, moved)

    def apply_copy(self, dst: PagedKVCache, copy: BlockCopy) -> None:
        """Perform a core :class:`BlockCopy` (swap in / out) from this cache into ``dst``. Only the
        blocks that hold tokens are moved (the source table may hold more)."""
        used = -(-copy.num_tokens // self.block_size)
        n = min(used, len(copy.src_blocks), len(copy.dst_blocks))
        if n < used:
            raise ValueError(f"request {copy.request_id}: copy of {copy.num_tokens} tokens needs {used} blocks, "
                             f"got {len(copy.src_blocks)} -> {len(copy.dst_blocks)}")
        self.copy_blocks(dst, copy.src_blocks[:n], copy.dst_blocks[:n])

    # ---- export / import (token-contiguous) ----------------------------------------------
    def export_tokens(self, blocks: Sequence[int], num_tokens: int) -> KVPayload:
        used = -(-num_tokens // self.block_size)
        if used > len(blocks):
            raise ValueError(f"{num_tokens} tokens need {used} blocks, the table holds {len(blocks)}")
        idx = torch.tensor(list(blocks[:used]), dtype=torch.long, device=self.device)
        kv = self.data.index_select(2, idx)            # [L, 2, used, bs, H, d]
        kv = kv.flatten(2, 3)[:, :, :num_tokens].to("cpu").contiguous()
        return KVPayload(num_tokens, kv)

    def import_tokens(self, blocks: Sequence[int], payload: KVPayload) -> None:
        kv = payload.kv
        expected = (self.num_layers, 2, payload.num_tokens, self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV payload of shape {tuple(kv.shape)} does not fit this cache (expected {expected})")
        used = -(-payload.num_tokens // self.block_size)
        if used > len(blocks):
            raise ValueError(f"{payload.num_tokens} tokens need {used} blocks, {len(blocks)} are allocated")
        pad = used * self.block_size - payload.num_tokens
        kv = kv.to(self.device, self.data.dtype)
        if pad:
            kv = torch.cat([kv, kv.new_zeros(*kv.shape[:2], pad, *kv.shape[3:])], dim=2)
        kv = kv.view(self.num_layers, 2, used, self.block_size, self.num_kv_heads, self.head_dim)
        idx = torch.tensor(list(blocks[:used]), dtype=torch.long, device=self.device)
        self.data.index_copy_(2, idx, kv)

    def _check_geometry(self, other: PagedKVCache) -> None:
        mine = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        theirs = (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim)
        if mine != theirs:
            raise ValueError(f"KV cache geometry mismatch: {mine} vs {theirs}")
