"""Shared machinery of decode-instance schedulers: KV reservation for incoming transfers, the
running set, growth of block tables, and preemption by swap (host pool) or recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Phase, Request
from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.policies.options import PolicyOptions, at_least


@dataclass(frozen=True, slots=True)
class DecodeOptions(PolicyOptions):
    """Options of every decode policy."""

    max_batch_size: int = 256
    preemption: Literal["swap", "recompute"] = "swap"     # when running requests cannot grow

    def validate(self) -> None:
        PolicyOptions.validate(self)
        at_least(self, "max_batch_size", 1)


class DecodeScheduler(InstanceScheduler):
    """Base for decode policies. A request reaches this instance in two steps: :meth:`reserve`
    (blocks for its KV, before the transfer starts) and :meth:`add_request` (KV arrived).

    Preemption when running requests cannot grow: ``"swap"`` parks the newest running request's
    KV in the host pool (falls back to recompute when the pool is full), ``"recompute"`` frees it
    and later re-prefills prompt + generated tokens on this instance.
    """

    role = "decode"
    Options = DecodeOptions
    options: DecodeOptions

    def __init__(self, kv: KVCacheManager, options: DecodeOptions | None = None, *,
                 host_pool: HostKVPool | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        self.max_batch_size = self.options.max_batch_size
        self.preemption = self.options.preemption
        self.host_pool = host_pool
        self.waiting: deque[Request] = deque()     # KV here, not yet running
        self.swapped: deque[Request] = deque()     # KV in the host pool
        self.recompute: deque[Request] = deque()   # KV dropped; re-prefill before decoding
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- arrival -------------------------------------------------------------------------
    def _batch_limit(self) -> int:
        """How many requests the running set may hold once this step's waiting requests are
        admitted (``max_batch_size``; adaptive decode lets it grow while TPOT allows)."""
        return self.max_batch_size

    def can_reserve(self, req: Request) -> bool:
        return self.kv.can_admit(req.request_id, req.context_len)

    def reserve(self, req: Request) -> list[int]:
        """Allocate the blocks an incoming KV transfer writes into."""
        return self.kv.allocate(req.request_id, req.context_len)

    def _enqueue(self, req: Request, now: float) -> None:
        req.phase = Phase.DECODE_WAITING
        self.waiting.append(req)

    def _remove(self, req: Request) -> None:
        for q in (self.waiting, self.swapped, self.recompute, self.running):
            try:
                q.remove(req)
                break
            except ValueError:
                continue
        if self.host_pool is not None:
            self.host_pool.free(req.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.recompute)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def queued_tokens(self) -> int:
        return sum(r.remaining_output for r in self.requests.values())

    # ---- step building -------------------------------------------------------------------
    @property
    def policy_preemptions(self) -> int:
        return self.num_preemptions

    def _grow_running(self, plan: StepPlan) -> None:
        """Make room for one more token in every running request, preempting the newest
        running requests (vLLM's rule) until the rest fit."""
        kv = self.kv
        tables, bs = kv.tables, kv.block_size
        running = self.running
        i = 0
        while i < len(running):
            req = running[i]
            # fast path: the next token still fits in the blocks the request holds
            if len(tables[req.request_id]) * bs >= req.prompt_len + req.num_output_tokens:
                i += 1
                continue
            if kv.can_grow(req.request_id, req.context_len):
                kv.allocate(req.request_id, req.context_len)
                i += 1
                continue
            victim = running.pop()
            self._preempt(victim, plan)
            # if the victim was req itself, i now points past the end and the loop stops

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.num_preemptions += 1
        req.num_preemptions += 1
        rid = req.request_id
        pool = self.host_pool
        if (self.preemption == "swap" and pool is not None
                and pool.can_admit(rid, req.num_computed_tokens)):
            plan.swap_out.append(pool.swap_out(self.kv, rid, req.num_computed_tokens))
            req.phase = Phase.SWAPPED
            self.swapped.append(req)
        else:
            self.kv.free(rid)
            req.num_computed_tokens = 0
            req.phase = Phase.DECODE_WAITING
            self.recompute.append(req)

    def _readmit_parked(self, plan: StepPlan, now: float) -> bool:
        """Bring back swapped, then recompute-preempted requests, oldest first. Returns False
        when the oldest parked request does not fit yet."""
        kv = self.kv
        while self.swapped and len(self.running) < self.max_batch_size:
            req = self.swapped[0]
            if not kv.can_admit(req.request_id, req.context_len):
                return False
            self.swapped.popleft()
            plan.swap_in.append(self.host_pool.swap_in(kv, req.request_id, req.num_computed_tokens))
            kv.allocate(req.request_id, req.context_len)
            req.phase = Phase.DECODING
            self.running.append(req)
        while self.recompute and len(self.running) < self.max_batch_size:
            req = self.recompute[0]
            target = req.context_len - 1      # prompt + all outputs but the newest, which the next decode runs
            cached = kv.match(req, target)    # blocks still cached (prefix caching), else none
            if not kv.can_admit(req.request_id, req.context_len, cached):
                return False
            self.recompute.popleft()
            kv.allocate(req.request_id, req.context_len, cached)
            start = len(cached) * kv.block_size
            req.num_computed_tokens = start
            plan.prefills.append(PrefillChunk(req, start, target - start))
        return True

    def _admit(self, req: Request, now: float) -> None:
        self.kv.allocate(req.request_id, req.context_len)
        req.phase = Phase.DECODING
        if req.times.decode_start is None:
            req.times.decode_start = now
        self.running.append(req)

    def _unstick(self, plan: StepPlan) -> bool:
        """In PD, waiting requests already hold their transferred KV. If nothing runs and the
        oldest waiting request cannot grow by one token, park the newest waiting one to free
        memory, so that the instance always makes progress. True if something was parked."""
        if self.running or plan.prefills or plan.swap_in or len(self.waiting) < 1:
            return False
        head = self.waiting[0]
        if self.kv.can_grow(head.request_id, head.context_len):
            return False
        if len(self.waiting) == 1:
            raise RuntimeError(f"request {head.request_id} cannot grow in an otherwise empty KV cache")
        self._preempt(self.waiting.pop(), plan)
        return True

    def _prepare_step(self, now: float) -> StepPlan:
        """The memory side of a step, common to every decode policy: grow the running requests
        (preempting when needed), bring parked ones back, then admit waiting requests in arrival
        order while slots and KV allow (they already hold their transferred KV, so they never
        wait behind parked ones). The policy then picks ``plan.decodes`` among ``self.running``."""
        plan = StepPlan(label=self.name)
        self._grow_running(plan)
        self._readmit_parked(plan, now)
        kv, waiting, running = self.kv, self.waiting, self.running
        limit = self._batch_limit() if waiting else self.max_batch_size
        while True:
            while waiting and len(running) < limit:
                req = waiting[0]
                if not kv.can_grow(req.request_id, req.context_len):
                    break
                waiting.popleft()
                self._admit(req, now)
            if not self._unstick(plan):
                break
        return plan

    def _after_update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        for chunk in plan.prefills:      # recomputed requests rejoin the running batch
            req = chunk.request
            if not req.is_finished:
                req.phase = Phase.DECODING
                self.running.append(req)
        if outcome.finished:
            done = {r.request_id for r in outcome.finished}
            self.running = [r for r in self.running if r.request_id not in done]
            for rid in done:
                self.release(rid)
