"""Shared machinery of prefill-instance schedulers: the waiting set, first-schedule bookkeeping
(prefix reuse, timestamps), KV admission of whole prompts, and the token budget."""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk
from laneserve.core.prefix_cache import PrefixCache, prefix_blocks
from laneserve.core.request import Phase, Request
from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.policies.options import PolicyOptions, at_least


@dataclass(frozen=True, slots=True)
class PrefillOptions(PolicyOptions):
    """Options of every prefill policy."""

    token_budget: int = 8192         # new tokens of one step
    max_batch_size: int = 256
    prefix_caching: bool = False     # reuse cached prompt KV

    def validate(self) -> None:
        PolicyOptions.validate(self)
        at_least(self, "token_budget", 1)
        at_least(self, "max_batch_size", 1)


class PrefillScheduler(InstanceScheduler):
    """Base for policies that only prefill. Requests stay in :attr:`requests` after their prompt
    is done until the instance loop calls :meth:`release` (their KV left for a decode instance).

    ``token_budget`` caps the new tokens of one step (the first request of a step is always
    admitted, so a prompt larger than the budget still runs alone). ``prefix_caching`` reuses
    cached prompt KV. On a KV manager with prefix caching (the engine) a request starts on the
    cached blocks of its leading tokens (``kv.match``) and is always on. In the simulator, with a
    :class:`~laneserve.core.prefix_cache.PrefixCache` bound (:meth:`bind_prefix_cache`) a request
    reuses the leading blocks this instance holds and leaves its own behind; without one, its
    ``prefix_len`` tokens count as cached wherever it runs (an idealisation: every instance holds
    every history).
    """

    role = "prefill"
    Options = PrefillOptions
    options: PrefillOptions

    def __init__(self, kv: KVCacheManager, options: PrefillOptions | None = None, **opts) -> None:
        super().__init__(kv, options, **opts)
        o = self.options
        self.token_budget = o.token_budget
        self.max_batch_size = o.max_batch_size
        self.prefix_caching = o.prefix_caching or kv.prefix_caching
        self.prefix_cache: PrefixCache | None = None
        self.pending: set[int] = set()      # ids whose prompt is not finished yet
        self._counted: dict[int, int] = {}  # remaining prefill of each pending id, as last seen
        self._queued_tokens = 0             # their sum (a running total: routers ask per arrival)

    def _enqueue(self, req: Request, now: float) -> None:
        req.phase = Phase.WAITING
        self.pending.add(req.request_id)
        self._recount(req)
        self._push(req, now)

    def _recount(self, req: Request) -> None:
        """Bring the running ``queued_tokens`` up to date after ``req``'s counters changed."""
        n = req.remaining_prefill
        self._queued_tokens += n - self._counted.get(req.request_id, 0)
        self._counted[req.request_id] = n

    def _unpend(self, request_id: int) -> None:
        self.pending.discard(request_id)
        self._queued_tokens -= self._counted.pop(request_id, 0)

    def _push(self, req: Request, now: float) -> None:
        raise NotImplementedError

    def _remove(self, req: Request) -> None:
        """Default for policies that keep their waiting requests in one sequence, ``self.queue``
        (FCFS, CP-EDF, Kairos); policies with other structures override it."""
        try:
            self.queue.remove(req)
        except ValueError:
            pass

    @property
    def num_waiting(self) -> int:
        return len(self.pending)

    @property
    def num_running(self) -> int:
        return 0

    @property
    def queued_tokens(self) -> int:
        """Remaining prompt tokens of the pending requests (kept per event, O(1) to read)."""
        return self._queued_tokens

    def bind_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Give this instance its own prefix cache (used only with ``prefix_caching``)."""
        self.prefix_cache = cache

    def cached_prefix(self, req: Request, *, touch: bool = False) -> int:
        """Prompt tokens of ``req`` this instance would not compute if it started it now (always
        leaves one token to compute). ``touch`` marks the cached blocks used and counts the hit."""
        if not self.prefix_caching:
            return 0
        if self.kv.prefix_caching:                     # the engine's blocks (counted at admission)
            return len(self.kv.match(req)) * self.kv.block_size
        cache = self.prefix_cache
        if cache is None:
            hit = req.prefix_len
        elif touch:
            hit = cache.match(prefix_blocks(req), touch=True)
        else:                    # schedulers ask often between changes of the cache: memoise
            memo = req.policy_state.prefix_memo
            if memo is not None and memo[0] is cache and memo[1] == cache.version:
                hit = memo[2]
            else:
                hit = cache.match(prefix_blocks(req))
                req.policy_state.prefix_memo = (cache, cache.version, hit)
        hit = min(hit, req.prompt_len - 1)
        if touch and cache is not None:
            cache.record(req.prompt_len, hit)
        return hit

    def new_tokens(self, req: Request) -> int:
        """Tokens the prefill of ``req`` computes: its remaining prefill once started; before, the
        prompt minus the prefix cached here now (what policies classify and predict by: LAPS lanes,
        S-EDF slack, Kairos finish times). A waiting request's figure is taken when the policy
        files it, so a cache that changes while it waits is seen at its admission."""
        done = req.num_computed_tokens
        if done == 0:
            done = self.cached_prefix(req)
        return max(req.prompt_len - done, 0)

    def refusal_bound(self, req: Request) -> float | None:
        """After :meth:`admit` refused ``req``: a prompt length at or above which no waiting
        request that has not started can be admitted either until memory is freed (its own, when
        it needs the blocks of its whole prompt), else None (it had started, holds blocks, or
        prefix caching makes the need depend on more than the length)."""
        kv = self.kv
        if req.times.prefill_start is not None or kv.prefix_caching or req.request_id in kv.tables:
            return None
        return req.prompt_len

    def refused_by_bound(self, req: Request, bound: float) -> bool:
        """Whether :meth:`admit` would refuse ``req`` after a refusal gave ``bound``
        (:meth:`refusal_bound`): it has not started, holds no blocks and is at least as long."""
        return req.times.prefill_start is None and req.prompt_len >= bound and req.request_id not in self.kv.tables

    def admit(self, req: Request, now: float) -> bool:
        """Reserve KV for the whole prompt the first time ``req`` is scheduled; False if it does
        not fit now (the caller decides whether to wait or skip)."""
        if req.times.prefill_start is not None:
            return True
        kv = self.kv
        if kv.prefix_caching:
            return self._admit_on_cached_blocks(req, now)
        if not kv.can_admit(req.request_id, req.prompt_len):
            return False
        kv.allocate(req.request_id, req.prompt_len)
        req.times.prefill_start = now
        if self.prefix_caching and req.num_computed_tokens == 0:
            cached = self.cached_prefix(req, touch=True)
            if cached > 0:
                req.num_computed_tokens = req.num_cached_tokens = cached
                self._recount(req)
        req.phase = Phase.PREFILLING
        return True

    def _admit_on_cached_blocks(self, req: Request, now: float) -> bool:
        kv = self.kv
        blocks = kv.match(req) if req.num_computed_tokens == 0 else []
        if not kv.can_admit(req.request_id, req.prompt_len, blocks):
            return False
        kv.allocate(req.request_id, req.prompt_len, blocks)
        req.times.prefill_start = now
        cached = len(blocks) * kv.block_size
        kv.record_query(req.prompt_len, cached)
        if cached:
            req.num_computed_tokens = req.num_cached_tokens = cached
            self._recount(req)
        req.phase = Phase.PREFILLING
        return True

    def chunk(self, req: Request, max_tokens: int) -> PrefillChunk:
        n = req.remaining_prefill
        return PrefillChunk(req, req.num_computed_tokens, n if n <= max_tokens else max_tokens)

    def _advance_prefill(self, chunk: PrefillChunk, sampled, stop_hit, now: float, outcome: StepOutcome) -> None:
        super()._advance_prefill(chunk, sampled, stop_hit, now, outcome)
        if chunk.request.request_id in self.pending:
            self._recount(chunk.request)

    def _after_update(self, plan, outcome: StepOutcome, now: float) -> None:
        for chunk in plan.prefills:
            if chunk.request.prefill_done:
                self._unpend(chunk.request.request_id)
                self._remove(chunk.request)
                if self.prefix_cache is not None and self.prefix_caching:
                    self.prefix_cache.insert(prefix_blocks(chunk.request))
        for req in outcome.finished:      # one-token outputs end here: nothing to hand off
            self.release(req.request_id)

    def abort(self, request_id: int, now: float, reason: str = "abort") -> Request | None:
        self._unpend(request_id)
        return super().abort(request_id, now, reason)
