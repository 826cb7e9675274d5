"""KV-length-aligned batching from a host KV pool (AlignedServe §3.2–3.5): the component
:class:`LengthAligner`, held as ``self.aligner`` by both ``alignedserve`` (:mod:`..alignedserve`)
and ``adaptive`` decode (:mod:`..adaptive`).

It owns everything aligned mode keeps besides the scheduler's own queues: the host-pool parking
of finished prefills indexed by KV length (:class:`~.quadtree.KVLengthQuadTree`), the candidate
batch and the candidate-requests buffer, their staging (:class:`~.aligned_prefetch.PrefetchStager`),
the batch-level decision at each iteration end (cases 1-3, dynamic prefetch, starvation) and its
statistics (:mod:`.aligned_stats`); the rules are spelled out in :mod:`..alignedserve`'s docstring.
With a guard (:class:`~.aligned_guard.AlignmentGuard`) it aligns only where that pays and runs
as continuous batching otherwise; without one (``alignedserve-literal``) it always aligns.

``host`` is the :class:`~..base.DecodeScheduler` holding it: the aligner reads and moves requests
between the host's ``running``, ``waiting``, ``swapped`` and ``recompute`` queues, uses its KV
manager and its memory rules (``_admit``, ``_readmit_parked``, ``_prepare_step``), and calls
``host._continuous_step`` for a continuous-batching step (so that a host can post-process it:
``adaptive`` selects who decodes there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from laneserve.core.kv import HostKVPool, blocks_for
from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Phase, Request
from laneserve.policies.base import StepOutcome
from laneserve.policies.decode.mechanisms.aligned_guard import AlignmentGuard
from laneserve.policies.decode.mechanisms.aligned_prefetch import PrefetchStager
from laneserve.policies.decode.mechanisms.aligned_stats import Aligned, AlignedBatch, AlignedStats
from laneserve.policies.decode.base import DecodeOptions
from laneserve.policies.decode.mechanisms.quadtree import KVLengthQuadTree, Selection
from laneserve.policies.options import at_least, option_error

SwitchEvict = Literal["all", "memory", "none"]


@dataclass(frozen=True, slots=True)
class AlignmentOptions(DecodeOptions):
    """The options of the aligner and its guard, declared once for every policy that holds them
    (``alignedserve``, adaptive decode), with AlignedServe's defaults."""

    threshold: float = 0.4
    n_min: int = 36
    starvation_bound: float | None = 30.0
    prefetch: bool = True
    prefetch_tokens_per_s: float | None = None
    staging_tokens: int | None = None
    dynamic: bool = True
    prefetch_window: int = 32
    headroom: float = 0.02
    leaf_width: int = 64
    switch_evict: SwitchEvict = "all"
    guard: bool = True
    tpot_margin: float = 0.2
    cb_memory_fraction: float = 0.8
    align_memory_fraction: float = 0.95

    def validate(self) -> None:
        DecodeOptions.validate(self)
        check_alignment_options(self)


def check_alignment_options(o: Any) -> None:
    """The checks of the options every aligning scheduler declares (:class:`AlignmentOptions`)."""
    if not 0 < o.threshold <= 1:
        raise option_error("threshold", "is a fraction of the decode KV blocks, in (0, 1]", o.threshold)
    at_least(o, "n_min", 1)
    at_least(o, "tpot_margin", 0)
    if not 0 < o.cb_memory_fraction <= o.align_memory_fraction <= 1:
        raise option_error("cb_memory_fraction", "and align_memory_fraction need "
                           "0 < cb_memory_fraction <= align_memory_fraction <= 1",
                           (o.cb_memory_fraction, o.align_memory_fraction))


def _since(req: Request, now: float) -> float:
    """When ``req`` started waiting in the length tree (``now`` if it has not yet)."""
    since = req.policy_state.of(Aligned).since
    return now if since is None else since


class LengthAligner:
    """Aligned batches for the decode scheduler ``host``, parking in ``pool``; ``o`` holds
    AlignedServe's option fields (``threshold``, ``n_min``, ``starvation_bound``, ``prefetch``,
    ...); ``guard`` None aligns always (the paper's algorithm)."""

    def __init__(self, host: Any, o: Any, pool: HostKVPool, guard: AlignmentGuard | None) -> None:
        kv = host.kv
        self.host = host
        self.pool = pool
        self.tree = KVLengthQuadTree(o.leaf_width)
        self.threshold_blocks = max(1, int(o.threshold * kv.num_blocks))
        self.n_min = o.n_min
        self.starvation_bound = o.starvation_bound if o.starvation_bound and o.starvation_bound > 0 else None
        self.prefetch = o.prefetch
        self.dynamic = o.dynamic
        self.prefetch_window = o.prefetch_window
        self.headroom_blocks = int(o.headroom * kv.num_blocks)
        self.switch_evict = o.switch_evict
        capacity = o.staging_tokens if o.staging_tokens is not None else kv.num_blocks * kv.block_size
        self.stager = PrefetchStager(o.prefetch_tokens_per_s if o.prefetch else None, capacity)
        self.cand_batch: list[Request] = []
        self.cand_info: AlignedBatch | None = None
        self.cand_reqs: list[Request] = []
        self.current: AlignedBatch | None = None
        self.iteration = 0
        self.stats = AlignedStats()
        self._next_batch_id = 0
        self._recomputing: set[int] = set()             # device KV re-prefilled by the step
        self.guard = guard
        self.aligning = guard is None        # guarded: start as continuous batching

    # ---- the guard -------------------------------------------------------------------------
    @property
    def never_aligns(self) -> bool:
        """Guarded and unable to align (no pool to park in, or a ragged cost model bound): the
        host is continuous batching for good."""
        return self.guard is not None and self.guard.never_aligns

    def bind_cost_model(self, cost_model) -> None:
        if self.guard is not None:
            self.guard.bind_cost_model(cost_model)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        if self.guard is not None:
            self.guard.observe(plan, result)

    def hold(self, req: Request) -> None:
        if self.guard is not None:
            self.guard.hold(req)

    def forget(self, req: Request) -> None:
        if self.guard is not None:
            self.guard.forget(req)

    def grew(self, req: Request) -> None:
        if self.guard is not None:
            self.guard.grew(req)

    # ---- arrival: the KV lands in the host pool while aligning -----------------------------
    def can_reserve(self, req: Request) -> bool:
        return self.pool.can_admit(req.request_id, req.context_len)

    def reserve(self, req: Request) -> list[int]:
        return self.pool.allocate(req.request_id, req.context_len)

    # ---- the modes -------------------------------------------------------------------------
    def _to_continuous(self, now: float) -> None:
        """Leave aligned mode: pooled requests queue (oldest first) to be swapped in as memory
        allows, by :class:`DecodeScheduler`'s own swap-in rule."""
        h = self.host
        self.aligning = False
        self.current = None
        pooled = [*self.cand_reqs, *self.cand_batch]
        entries = sorted(self.tree.iter_entries(), key=lambda e: (e.since, e.request_id))
        pooled += [self._from_tree(e.request_id, now) for e in entries]
        self.cand_reqs, self.cand_batch, self.cand_info = [], [], None
        for req in pooled:
            self.stager.unstage(req)
            req.policy_state.of(Aligned).batch = None
            req.phase = Phase.SWAPPED
            h.swapped.append(req)

    def _to_aligned(self, plan: StepPlan, now: float) -> None:
        """Enter aligned mode: device-resident waiting requests join the running set while it has
        slots (they hold their blocks; case 3 evicts if needed) up to ``n_min`` (what an
        unaligned batch may fill: the under-filled rule), the rest are evicted to the pool;
        swapped ones go to the quad-tree. The running set is no aligned batch, so the first
        candidate batch forms at once (:meth:`_undersaturated`) and the switch rule replaces it."""
        h = self.host
        self.aligning = True
        cap = min(self.n_min, h.max_batch_size)
        while h.waiting and len(h.running) < cap:
            h._admit(h.waiting.popleft(), now)
        while h.waiting:
            self._evict(h.waiting.popleft(), plan, now)
        while h.swapped:
            req = h.swapped.popleft()
            self._to_tree(req, _since(req, now))

    def continuous_step(self, now: float) -> StepPlan | None:
        """Continuous batching's step (the host's memory rules), everyone decoding."""
        h = self.host
        plan = h._prepare_step(now)
        self._recomputing = {c.request.request_id for c in plan.prefills}
        plan.decodes = list(h.running)
        for req in plan.decodes:
            if req.times.decode_start is None:
                req.times.decode_start = now
        return None if plan.is_empty else plan

    # ---- arrival: the KV lands in the host pool --------------------------------------------
    def enqueue(self, req: Request, now: float) -> None:
        h = self.host
        req.phase = Phase.DECODE_WAITING
        if req.request_id in h.kv.tables:        # reserved on the device (continuous mode)
            h.waiting.append(req)
        elif self.aligning:
            self._to_tree(req, now)
        else:
            req.phase = Phase.SWAPPED
            h.swapped.append(req)

    def _to_tree(self, req: Request, since: float) -> None:
        req.policy_state.of(Aligned).since = since
        req.policy_state.of(Aligned).batch = None
        self.tree.insert(req.request_id, req.context_len, self.pool.num_allocated(req.request_id), since)

    def _from_tree(self, request_id: int, now: float) -> Request:
        h = self.host
        entry = self.tree.remove(request_id)
        self.stats.pool_waits.append(now - entry.since)
        return h.requests[request_id]

    # ---- queues ----------------------------------------------------------------------------
    def remove(self, req: Request) -> None:
        h = self.host
        rid = req.request_id
        if rid in self.tree:
            self.tree.remove(rid)
        for q in (self.cand_batch, self.cand_reqs, h.running, h.waiting, h.swapped):
            if req in q:
                q.remove(req)
        if req in h.recompute:
            h.recompute.remove(req)
        self.stager.unstage(req)
        self.pool.free(rid)

    @property
    def num_waiting(self) -> int:
        h = self.host
        return (len(self.tree) + len(self.cand_batch) + len(self.cand_reqs) + len(h.recompute)
                + len(h.waiting) + len(h.swapped))

    # ---- the iteration-end decision --------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        h = self.host
        if self.guard is not None:
            pays = self.guard.pays(self.aligning, h.requests, h.kv)
            if not pays:
                if self.aligning:
                    self._to_continuous(now)
                return h._continuous_step(now)
        plan = StepPlan(label=h.name)
        if self.guard is not None and (not self.aligning or h.waiting or h.swapped):
            self._to_aligned(plan, now)
        self._make_room(plan, now)                       # case 3
        if self.dynamic:
            self._dynamic_prefetch(now)
        self._prepare_candidate_batch(now)
        self._admit_candidates(plan, now)                # case 1
        if self.cand_batch and self._should_switch():
            self._switch(plan, now)                      # case 2
        h._readmit_parked(plan, now)                  # recompute fallback (pool full)
        self._recomputing = {c.request.request_id for c in plan.prefills}
        plan.decodes = list(h.running)
        return None if plan.is_empty else plan

    def _need_blocks(self, req: Request) -> int:
        h = self.host
        have = h.kv.num_allocated(req.request_id)
        need = blocks_for(req.context_len, h.kv.block_size) - have
        return need if need > 0 else 0

    def _make_room(self, plan: StepPlan, now: float) -> None:
        """Every running request must hold its next token; evict the longest until they do."""
        h = self.host
        running, kv = h.running, h.kv
        need = sum(self._need_blocks(r) for r in running)
        free = kv.num_free_blocks
        while need > free and running:
            victim = self._victim()
            need -= self._need_blocks(victim)
            free += kv.num_allocated(victim.request_id)
            running.remove(victim)
            self._evict(victim, plan, now)
        for r in running:
            kv.allocate(r.request_id, r.context_len)

    def _victim(self) -> Request:
        h = self.host
        cur = self.current.batch_id if self.current else None
        old = [r for r in h.running if r.policy_state.of(Aligned).batch != cur]
        return max(old or h.running, key=lambda r: (r.context_len, r.request_id))

    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        h = self.host
        rid, tokens = req.request_id, req.num_computed_tokens
        h.num_preemptions += 1
        req.num_preemptions += 1
        self.stats.evictions += 1
        if not self.pool.can_admit(rid, tokens):      # host pool full: drop and recompute
            self.stats.recomputes += 1
            h.kv.free(rid)
            req.num_computed_tokens = 0
            req.phase = Phase.DECODE_WAITING
            h.recompute.append(req)
            return
        plan.swap_out.append(self.pool.swap_out(h.kv, rid, tokens))
        self.stats.swap_out_tokens += tokens
        req.phase = Phase.SWAPPED
        if self.current is not None and req.policy_state.of(Aligned).batch == self.current.batch_id:
            self.cand_reqs.append(req)                # evicted to the peer GPU buffer: staged now
            if self.prefetch:
                self.stager.stage(req, tokens, now, immediate=True)
        else:                                         # old batch: back to the pool, keeping its timer
            self._to_tree(req, _since(req, now))

    def _dynamic_prefetch(self, now: float) -> None:
        cur = self.current
        if cur is None or cur.start_iter is None or (self.cand_info is not None and self.cand_info.starving):
            return
        room = self.prefetch_window - sum(1 for r in self.cand_reqs if r.policy_state.of(Aligned).batch == cur.batch_id)
        if room <= 0 or not len(self.tree):
            return
        shift = self.iteration - cur.start_iter
        for entry in self.tree.in_range(cur.lo + shift, cur.hi + shift, room):
            if self.prefetch and not self.stager.can_stage(entry.length):
                break
            req = self._from_tree(entry.request_id, now)
            req.policy_state.of(Aligned).batch = cur.batch_id
            if self.prefetch:
                self.stager.stage(req, req.num_computed_tokens, now)
            self.cand_reqs.append(req)
            self.stats.aligned_prefetches += 1

    def _prepare_candidate_batch(self, now: float) -> None:
        h = self.host
        tree = self.tree
        leaf = tree.starving_leaf(now, self.starvation_bound) if self.starvation_bound is not None else None
        if leaf is not None and self.cand_batch and not self.cand_info.starving:   # type: ignore[union-attr]
            for req in self.cand_batch:               # priority to the starving subtree
                self.stager.unstage(req)
                self._to_tree(req, _since(req, now))
            self.cand_batch, self.cand_info = [], None
        if self.cand_batch or not len(tree):
            return
        if leaf is not None:
            oldest = tree.oldest(leaf)
            sel = tree.grow(leaf, self.threshold_blocks, self.n_min, h.max_batch_size, force_one=True)
            self.stats.starvation_log.append((now, now - oldest.since, oldest.request_id in sel.request_ids))
            self._form(sel, now, starving=True)
            return
        sel = tree.density_first(self.threshold_blocks, self.n_min, h.max_batch_size)
        if sel is None or (not sel.full and not self._undersaturated()):
            return
        self._form(sel, now, starving=False)

    def _undersaturated(self) -> bool:
        h = self.host
        if self.guard is not None and self.current is None and h.running:
            return True                               # left from continuous mode: not aligned
        cur = self.current.batch_id if self.current else None
        queued = sum(1 for r in self.cand_reqs if r.policy_state.of(Aligned).batch == cur)
        return len(h.running) + queued < self.n_min

    def _form(self, sel: Selection, now: float, *, starving: bool) -> None:
        if not sel.request_ids:
            return
        info = AlignedBatch(self._next_batch_id, sel.lo, sel.hi, len(sel), now, sel.full, starving)
        self._next_batch_id += 1
        batch = []
        for rid in sel.request_ids:
            req = self._from_tree(rid, now)
            req.policy_state.of(Aligned).batch = info.batch_id
            if self.prefetch:
                self.stager.stage(req, req.num_computed_tokens, now)
            batch.append(req)
        self.cand_batch, self.cand_info = batch, info
        st = self.stats
        st.batches_formed += 1
        st.full_batches += sel.full
        st.starvation_batches += starving
        st.batch_sizes.append(len(sel))
        st.batch_spans.append(sel.hi - sel.lo)

    def _fits(self, req: Request) -> bool:
        h = self.host
        need = blocks_for(req.context_len, h.kv.block_size)
        reserve = self.headroom_blocks if h.running else 0
        return need + reserve <= h.kv.num_free_blocks

    def _admit_candidates(self, plan: StepPlan, now: float) -> None:
        """Case 1: candidate requests of the running batch join while slots and memory allow."""
        h = self.host
        cur = self.current.batch_id if self.current else None
        keep: list[Request] = []
        blocked = False
        for req in self.cand_reqs:
            if blocked or req.policy_state.of(Aligned).batch != cur:
                keep.append(req)
                continue
            if len(h.running) >= h.max_batch_size or not self._fits(req):
                blocked = True
                keep.append(req)
                continue
            if self.stager.ready_at(req) > now:        # its prefetch has not finished yet
                self.stager.wait_events += 1
                keep.append(req)
                continue
            self._swap_in(req, plan, now)
        self.cand_reqs = keep

    def _swap_in(self, req: Request, plan: StepPlan, now: float) -> None:
        h = self.host
        rid = req.request_id
        plan.swap_in.append(self.pool.swap_in(h.kv, rid, req.num_computed_tokens))
        h.kv.allocate(rid, req.context_len)
        self.stats.swap_in_tokens += req.num_computed_tokens
        self.stager.unstage(req)
        req.phase = Phase.DECODING
        if req.times.decode_start is None:
            req.times.decode_start = now
        h.running.append(req)

    def _should_switch(self) -> bool:
        h = self.host
        cur = self.current.batch_id if self.current else None
        if any(r.policy_state.of(Aligned).batch == cur for r in self.cand_reqs):
            return False                              # case 1 still has requests of this batch
        if self.current is None or not h.running:
            return True
        # the running batch no longer saturates the GPU: below n_min, or (a batch formed
        # smaller than n_min: starvation, memory-bound long requests) below half its peak
        members = sum(1 for r in h.running if r.policy_state.of(Aligned).batch == cur)
        return members < min(self.n_min, (self.current.peak + 1) // 2)

    def _switch(self, plan: StepPlan, now: float) -> None:
        h = self.host
        info = self.cand_info
        assert info is not None
        info.start_iter, info.started_at = self.iteration, now
        if info.starving:
            self.stats.starving_switch_delays.append(now - info.formed_at)
        self.current = info
        self.stats.switches += 1
        for req in self.cand_reqs:                    # leftovers of the old batch: back to the pool
            self.stager.unstage(req)
            self._to_tree(req, now)
        self.cand_reqs, self.cand_batch, self.cand_info = self.cand_batch, [], None
        old = [r for r in h.running if r.policy_state.of(Aligned).batch != info.batch_id]
        if old and self.switch_evict == "all" and (info.full or info.starving):
            lo, hi = info.lo, info.hi
            for req in old:
                if lo <= req.context_len <= hi:       # aligned with the new batch: it stays
                    req.policy_state.of(Aligned).batch = info.batch_id
                else:
                    h.running.remove(req)
                    self._evict(req, plan, now)
        elif old and self.switch_evict in ("all", "memory"):
            need = sum(blocks_for(r.context_len, h.kv.block_size) for r in self.cand_reqs)
            need += self.headroom_blocks
            old.sort(key=lambda r: (r.context_len, r.request_id))
            while need > h.kv.num_free_blocks and old:
                victim = old.pop()                    # the longest of the old batch
                h.running.remove(victim)
                self._evict(victim, plan, now)
        self._admit_candidates(plan, now)

    def next_wakeup(self) -> float | None:
        h = self.host
        if h.running:
            return None
        ready = [self.stager.ready_at(r) for r in self.cand_reqs]
        return min(ready) if ready else None

    # ---- after the step --------------------------------------------------------------------
    def after_step(self, plan: StepPlan) -> None:
        """The step's results are in (after the host's own bookkeeping)."""
        h = self.host
        self._recomputing = set()
        cur = self.current
        if cur is not None:
            members = sum(1 for r in h.running if r.policy_state.of(Aligned).batch == cur.batch_id)
            cur.peak = max(cur.peak, members)
        if plan.decodes:
            self.iteration += 1
            self.stats.decode_steps += 1
            first = plan.decodes[0].policy_state.of(Aligned).batch
            if any(r.policy_state.of(Aligned).batch != first for r in plan.decodes):
                self.stats.mixed_steps += 1


class AlignedWiring:
    """The scheduler side of a :class:`LengthAligner`, for a decode policy that holds one as
    ``self.aligner`` (mixed in before :class:`~..base.DecodeScheduler`: ``AlignedServeDecode`` and
    adaptive decode). The guard's running figures follow every request held; arrivals, queues,
    decisions and the end of each step are the aligner's. A policy adds only what is its own."""

    aligner: LengthAligner

    # ---- the aligner's state, as the scheduler's (tests, benchmarks) ------------------------
    @property
    def pool(self):
        return self.aligner.pool

    @property
    def stats(self):
        return self.aligner.stats

    @property
    def aligning(self) -> bool:
        return self.aligner.aligning

    @property
    def kv_lands_in_host(self) -> bool:        # type: ignore[override]
        """Incoming KV goes to the host pool while aligning, to the device otherwise."""
        return self.aligner.aligning

    # ---- the guard's running figures follow every request held ------------------------------
    def add_request(self, req: Request, now: float) -> None:
        super().add_request(req, now)
        self.aligner.hold(req)

    def release(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self.aligner.forget(req)
        super().release(request_id)

    def abort(self, request_id: int, now: float, reason: str = "abort") -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.aligner.forget(req)
        return super().abort(request_id, now, reason)

    def _advance_decode(self, req: Request, sampled: dict[int, int] | None,
                        stop_hit: set[int] | None, now: float, outcome: StepOutcome) -> None:
        super()._advance_decode(req, sampled, stop_hit, now, outcome)
        if req.request_id in self.requests:          # (not aborted mid-step)
            self.aligner.grew(req)

    # ---- arrival: the KV lands in the host pool while aligning ------------------------------
    def can_reserve(self, req: Request) -> bool:
        if not self.aligner.aligning:
            return super().can_reserve(req)
        return self.aligner.can_reserve(req)

    def reserve(self, req: Request) -> list[int]:
        if not self.aligner.aligning:
            return super().reserve(req)
        return self.aligner.reserve(req)

    def _enqueue(self, req: Request, now: float) -> None:
        self.aligner.enqueue(req, now)

    # ---- queues and decisions ---------------------------------------------------------------
    def _remove(self, req: Request) -> None:
        self.aligner.remove(req)

    @property
    def num_waiting(self) -> int:
        return self.aligner.num_waiting

    def schedule(self, now: float) -> StepPlan | None:
        return self.aligner.schedule(now)

    def next_wakeup(self) -> float | None:
        return self.aligner.next_wakeup()

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        self.aligner.observe(plan, result)
        return super().update(plan, result, now)

    def _after_update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        super()._after_update(plan, outcome, now)
        self.aligner.after_step(plan)
