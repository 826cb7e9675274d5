"""AlignedServe's do-no-harm guard (:class:`AlignmentGuard`) and the running figures it reads
(:class:`HeldFigures`; a decision reads them in O(1) instead of scanning every request the
instance holds): the KV blocks every held request needs for its next token, the total and the
longest context, and the tightest TPOT target. The policy updates them when a request arrives,
decodes a token and leaves."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from laneserve.core.kv import blocks_for
from laneserve.costmodel.base import contexts  # noqa: F401  (re-exported: the guard's batches)
from laneserve.costmodel.base import decode_summary_time
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


class AlignmentGuard:
    """AlignedServe's do-no-harm guard (docs/design.md, "Do no harm"), held by the
    :class:`~.aligner.LengthAligner` of ``alignedserve`` (with ``guard=True``) and of
    ``adaptive`` decode: align only where the predicted step-time saving is real and continuous
    batching is in trouble (the rule is spelled out in :mod:`..alignedserve`'s docstring).

    It predicts steps from the bound cost model (:meth:`step_time`; without one, from the last
    observed pure decode step, :meth:`observe`) and reads :class:`HeldFigures` kept as requests
    arrive (:meth:`hold`), decode (:meth:`grew`) and leave (:meth:`forget`). ``can_align=False``
    (no host pool to park in) or a ragged kernel (:meth:`bind_cost_model`) mean it never aligns,
    and then it keeps no figures."""

    def __init__(self, block_size: int, *, can_align: bool, tpot_margin: float,
                 cb_memory_fraction: float, align_memory_fraction: float) -> None:
        self.can_align = can_align
        self.tpot_margin = tpot_margin
        self.cb_memory_fraction, self.align_memory_fraction = cb_memory_fraction, align_memory_fraction
        self.cost_model = None
        self.last_step: tuple[int, float] | None = None   # (decodes, seconds) of the last pure step
        self.never_aligns = not can_align                 # for good
        # the figures over the requests held; None where no decision reads them
        self.held: HeldFigures | None = None if self.never_aligns else HeldFigures(block_size)

    def bind_cost_model(self, cost_model) -> None:
        self.cost_model = cost_model
        # a ragged kernel charges a batch its total context, which no grouping lowers
        self.never_aligns = not self.can_align or getattr(cost_model, "attention", None) == "ragged"
        if self.never_aligns:
            self.held = None

    def observe(self, plan, result) -> None:
        """A step ended: a completed pure decode step is the last one observed."""
        if result.completed and plan.decodes and not (plan.prefills or plan.swap_in or plan.swap_out):
            self.last_step = (len(plan.decodes), result.duration)

    # ---- the figures follow every request held ---------------------------------------------
    def hold(self, req: Request) -> None:
        if self.held is not None:
            self.held.hold(req)

    def forget(self, req: Request) -> None:
        if self.held is not None:
            self.held.forget(req)

    def grew(self, req: Request) -> None:
        if self.held is not None:
            self.held.grew(req)

    # ---- the decision ----------------------------------------------------------------------
    def step_time(self, n: int, total: int, longest: int) -> float | None:
        """Predicted step of ``n`` requests whose contexts sum to ``total``, the longest
        ``longest`` (the cost models charge a decode batch by these three figures); without a
        cost model, the last observed pure step scaled by the batch size."""
        if n == 0:
            return 0.0
        if self.cost_model is None:
            if self.last_step is None:
                return None
            size, seconds = self.last_step
            return seconds * max(1.0, n / size)
        return decode_summary_time(self.cost_model, n, total, longest)

    def pays(self, aligning: bool, requests: dict[int, Request], kv) -> bool:
        """Whether to align the next step, for an instance holding ``requests`` on ``kv``
        (``aligning``: whether it aligns now, for the memory hysteresis)."""
        if self.never_aligns:
            return False
        model = self.cost_model
        held = self.held
        assert held is not None
        limit = self.cb_memory_fraction if aligning else self.align_memory_fraction
        binds = held.blocks > limit * kv.num_blocks
        tpot = held.min_tpot()
        if not binds and tpot is None:
            return False
        n, total = len(requests), held.context
        longest = held.longest(requests.values()) if model is not None else 0
        step = self.step_time(n, total, longest)
        if step is None:
            return binds
        if not binds and step * (1 + self.tpot_margin) <= tpot:
            return False                   # everyone decodes within the tightest TPOT target
        if model is None:
            return True                    # no model to predict the padding saving with
        uniform = self.step_time(n, total, -(-total // n))
        return step - uniform >= self.tpot_margin * step     # the padding alignment can save
