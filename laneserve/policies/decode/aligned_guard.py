"""The running figures AlignedServe's do-no-harm guard reads (a decision reads them in
O(1) instead of scanning every request the instance holds): the KV blocks every held request
needs for its next token, the total and the longest context, and the tightest TPOT target. The
policy updates them when a request arrives, decodes a token and leaves."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from laneserve.core.kv import blocks_for
from laneserve.costmodel.base import contexts  # noqa: F401  (re-exported: the guard's batches)
from laneserve.core.request import Request
from laneserve.core.sorted_keys import SortedKeys


@dataclass(slots=True)
class HeldFigures:
    block_size: int
    blocks: int = 0                      # sum of blocks_for(context_len + 1): the next token's demand
    context: int = 0                     # sum of context_len
    _longest: int | None = 0             # max context_len; None after the longest left (rescan on demand)
    _targets: SortedKeys = field(default_factory=SortedKeys)     # (tpot, request_id)

    def hold(self, req: Request) -> None:
        ctx = req.context_len
        self.blocks += blocks_for(ctx + 1, self.block_size)
        self.context += ctx
        if self._longest is not None and ctx > self._longest:
            self._longest = ctx
        if req.slo.tpot is not None:
            self._targets.add((req.slo.tpot, req.request_id))

    def grew(self, req: Request) -> None:
        """``req`` decoded one token."""
        ctx = req.context_len
        self.context += 1
        if ctx % self.block_size == 0:   # blocks_for(ctx + 1) just passed a block boundary
            self.blocks += 1
        if self._longest is not None and ctx > self._longest:
            self._longest = ctx

    def forget(self, req: Request) -> None:
        ctx = req.context_len
        self.blocks -= blocks_for(ctx + 1, self.block_size)
        self.context -= ctx
        if self._longest is not None and ctx >= self._longest:
            self._longest = None
        if req.slo.tpot is not None:
            self._targets.remove((req.slo.tpot, req.request_id))

    def longest(self, held: Iterable[Request]) -> int:
        """The longest context among ``held`` (the requests counted here)."""
        if self._longest is None:
            self._longest = max((r.context_len for r in held), default=0)
        return self._longest

    def min_tpot(self) -> float | None:
        first = self._targets.first()
        return None if first is None else first[0]
