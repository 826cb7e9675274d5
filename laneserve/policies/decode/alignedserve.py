"""AlignedServe decode: prefix-length-aligned batches from a host KV pool (AlignedServe §3.2–3.5).

Finished prefills land in the instance's :class:`~laneserve.core.kv.HostKVPool` (``reserve``
allocates host blocks; ``kv_lands_in_host`` tells the engine cluster to import there) and wait,
indexed by KV length in a :class:`KVLengthQuadTree`. Density-first search (§3.3) turns a subtree
into the **candidate batch**, which is staged (prefetched) while the running batch decodes
(:mod:`.aligned_prefetch`). At each iteration end, batch-level scheduling (§3.4, Algorithm 2):

* case 3 first — when the running requests cannot all grow by one token, evict the longest (during
  a switch, the longest of the *old* batch) to host memory: a member of the running batch goes to
  the **candidate-requests buffer**, an old-batch member back to the quad-tree;
* case 1 — fill free KV / batch slots from the candidate-requests buffer (requests of the running
  batch: evicted ones, and pool requests aligned with it, moved there by dynamic prefetch, §3.5);
* case 2 — when that buffer holds nothing for the running batch and the batch no longer saturates
  the GPU (fewer than ``n_min`` of its members decode, or — for a batch that started below
  ``n_min``, e.g. memory-bound long requests — fewer than half its peak), switch: the candidate
  batch becomes the running batch and its members move to the candidate-requests buffer, admitted
  as memory allows. ``switch_evict`` says what happens to the old batch: ``"all"`` (default) keeps
  its members aligned with the new window and evicts the rest at once, for a full or starvation
  batch ("evict the old batch out of HBM as soon as possible"); ``"memory"`` (the paper's literal
  case 3) evicts its longest only while the new batch does not fit; ``"none"`` never. Iterations
  that decode members of two batches are counted (``stats.switch_iteration_share``).

Alignment of a running batch: its length window ``[lo, hi]`` at formation slides up by one per
decode iteration since it began running; dynamic prefetch takes pool requests inside the window
(oldest first, at most ``prefetch_window`` buffered). Starvation (§3.5): when the pool's oldest
request has waited longer than ``starvation_bound`` seconds, its leaf seeds the next batch (the
prepared candidate batch, if not itself a starvation batch, returns to the pool) with ``n_min``
relaxed, and dynamic prefetch pauses so that the switch comes soon. A batch that misses ``n_min``
is used only while the GPU would otherwise be under-filled (running batch below ``n_min``).

Choices where the paper is silent are documented here and in :mod:`.quadtree`: the window rule,
the switch trigger, ``switch_evict``, the under-filled fallback, and where evicted requests go (a
member of the running batch to the candidate-requests buffer; an old-batch member back to the tree,
indexed by its grown length and keeping its starvation timer). The host pool being full at an
eviction falls back to recompute (KV dropped, re-prefilled on this instance).

Do no harm (``guard=True``, the default; docs/design.md, "Do no harm"). Aligning saves step time only where the
attention kernel pads a mixed batch to its longest member; a ragged kernel charges a batch its
total context, which no grouping lowers, so there parking requests in the host pool only delays
them (a parked request's first token is out: every second it waits adds to its TPOT) and the
guarded policy is continuous batching whatever the memory does (continuous batching swaps to the
host pool itself when memory runs out; measured: aligning there lost TPOT attainment and league
goodput on long-context Mooncake-length traffic). With a padding (or unknown) kernel, before each
step the guard predicts the everyone-decodes step from the bound cost model (else the last
observed pure step, scaled by the batch size) and aligns only when continuous batching is in
trouble -- the decode KV demand of every request held passes ``align_memory_fraction`` of the
device blocks (continuous batching would preempt; once aligned, it stays so until the demand falls
below ``cb_memory_fraction``, a hysteresis), or that step times ``1 + tpot_margin`` breaks the
tightest TPOT target -- and the padding the step pays (its time less that of a batch of the same
total context at uniform length) is at least ``tpot_margin`` of it. Otherwise it runs as
continuous batching: incoming KV lands on the device, pooled requests are swapped in, everyone
decodes. Entering aligned mode, the batch left running from continuous mode is no aligned batch:
device-resident waiting requests join it only up to ``n_min`` and the first length-aligned batch
replaces it at once (on AlignedServe's 95%-short mix the mixed batch otherwise lingered ~1,000
steps: 2.18x continuous batching's decode throughput instead of 2.57x). The guard reads running
figures (:mod:`.aligned_guard`) kept as requests arrive, decode and leave, so a decision costs O(1)
however many requests are held (the longest context is rescanned only after the longest request
left, and only with a padding cost model).
``alignedserve-literal`` (``guard=False``) is the paper's algorithm, used by
``benchmarks/decode_alignedserve.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laneserve.core.kv import HostKVPool, KVCacheManager, blocks_for
from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Phase, Request
from laneserve.policies.base import StepOutcome
from laneserve.costmodel.base import decode_summary_time
from laneserve.policies.decode.aligned_guard import HeldFigures
from laneserve.policies.decode.aligned_prefetch import PrefetchStager
from laneserve.policies.decode.aligned_stats import AlignedBatch, AlignedStats
from laneserve.policies.decode.base import DecodeOptions, DecodeScheduler
from laneserve.policies.options import at_least, option_error
from laneserve.policies.decode.quadtree import KVLengthQuadTree, Selection
from laneserve.policies.registry import register


def _since(req: Request, now: float) -> float:
    """When ``req`` started waiting in the length tree (``now`` if it has not yet)."""
    since = req.policy_state.aligned_since
    return now if since is None else since


@dataclass(frozen=True, slots=True)
class AlignedServeOptions(DecodeOptions):
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
    switch_evict: Literal["all", "memory", "none"] = "all"
    guard: bool = True
    tpot_margin: float = 0.2
    cb_memory_fraction: float = 0.8
    align_memory_fraction: float = 0.95

    def validate(self) -> None:
        DecodeOptions.validate(self)
        if not 0 < self.threshold <= 1:
            raise option_error("threshold", "is a fraction of the decode KV blocks, in (0, 1]", self.threshold)
        at_least(self, "n_min", 1)
        at_least(self, "tpot_margin", 0)
        if not 0 < self.cb_memory_fraction <= self.align_memory_fraction <= 1:
            raise option_error("cb_memory_fraction", "and align_memory_fraction need "
                               "0 < cb_memory_fraction <= align_memory_fraction <= 1",
                               (self.cb_memory_fraction, self.align_memory_fraction))


@register("decode", "alignedserve", aliases={"aligned": {}, "alignedserve-nop": {"prefetch": False, "guard": False},
                                             "alignedserve-literal": {"guard": False}})
class AlignedServeDecode(DecodeScheduler):
    name = "alignedserve"
    needs_host_pool = True
    can_align = True        # a subclass may say no (adaptive decode without a host pool)

    Options = AlignedServeOptions
    options: AlignedServeOptions

    def __init__(self, kv: KVCacheManager, options: AlignedServeOptions | None = None, *,
                 host_pool: HostKVPool | None = None, **opts) -> None:
        if host_pool is None:
            raise ValueError("alignedserve needs a host KV pool (ClusterConfig.host_kv_tokens / "
                             "EngineConfig.num_host_blocks)")
        super().__init__(kv, options, host_pool=host_pool, **opts)
        o = self.options
        threshold, n_min, starvation_bound, prefetch = o.threshold, o.n_min, o.starvation_bound, o.prefetch
        leaf_width, headroom, staging_tokens = o.leaf_width, o.headroom, o.staging_tokens
        self.pool = host_pool
        self.tree = KVLengthQuadTree(leaf_width)
        self.threshold_blocks = max(1, int(threshold * kv.num_blocks))
        self.n_min = n_min
        self.starvation_bound = starvation_bound if starvation_bound and starvation_bound > 0 else None
        self.prefetch = prefetch
        self.dynamic = o.dynamic
        self.prefetch_window = o.prefetch_window
        self.headroom_blocks = int(headroom * kv.num_blocks)
        self.switch_evict = o.switch_evict
        capacity = staging_tokens if staging_tokens is not None else kv.num_blocks * kv.block_size
        self.stager = PrefetchStager(o.prefetch_tokens_per_s if prefetch else None, capacity)
        self.cand_batch: list[Request] = []
        self.cand_info: AlignedBatch | None = None
        self.cand_reqs: list[Request] = []
        self.current: AlignedBatch | None = None
        self.iteration = 0
        self.stats = AlignedStats()
        self._next_batch_id = 0
        self._recomputing: set[int] = set()             # device KV re-prefilled by the step
        self.guard = o.guard
        self.tpot_margin = o.tpot_margin
        self.cb_memory_fraction, self.align_memory_fraction = o.cb_memory_fraction, o.align_memory_fraction
        self.aligning = not o.guard        # guarded: start as continuous batching
        self._cost_model = None
        self._last_step: tuple[int, float] | None = None  # (decodes, seconds) of the last pure step
        # guarded and unable to align (no pool to park in, or a ragged cost model bound): for good
        self._never_aligns = o.guard and not self.can_align
        # the guard's figures over self.requests; None where no guard reads them
        self._held: HeldFigures | None = (HeldFigures(kv.block_size) if o.guard and not self._never_aligns
                                          else None)

    # ---- do no harm: is alignment worth it now? ---------------------------------------------
    @property
    def kv_lands_in_host(self) -> bool:        # type: ignore[override]
        """Incoming KV goes to the host pool while aligning, to the device otherwise."""
        return self.aligning

    def bind_cost_model(self, cost_model) -> None:
        self._cost_model = cost_model
        # a ragged kernel charges a batch its total context, which no grouping lowers
        self._never_aligns = self.guard and (not self.can_align
                                             or getattr(cost_model, "attention", None) == "ragged")
        if self._never_aligns:
            self._held = None

    @property
    def stable_decode_batch(self) -> bool:      # type: ignore[override]
        """Guarded on a ragged kernel, the policy is continuous batching for good (and keeps no
        guard figures, so a simulator may run its stable batches as one event)."""
        return self._never_aligns

    def _step_time(self, n: int, total: int, longest: int) -> float | None:
        """Predicted step of ``n`` requests whose contexts sum to ``total``, the longest
        ``longest`` (the cost models charge a decode batch by these three figures); without a
        cost model, the last observed pure step scaled by the batch size."""
        if n == 0:
            return 0.0
        if self._cost_model is None:
            if self._last_step is None:
                return None
            size, seconds = self._last_step
            return seconds * max(1.0, n / size)
        return decode_summary_time(self._cost_model, n, total, longest)

    def _alignment_pays(self) -> bool:
        """The guard: align only where the predicted step-time saving is real and
        continuous batching is in trouble (see the module docstring)."""
        if self._never_aligns:
            return False
        model = self._cost_model
        held = self._held
        assert held is not None
        limit = self.cb_memory_fraction if self.aligning else self.align_memory_fraction
        binds = held.blocks > limit * self.kv.num_blocks
        tpot = held.min_tpot()
        if not binds and tpot is None:
            return False
        n, total = len(self.requests), held.context
        longest = held.longest(self.requests.values()) if model is not None else 0
        step = self._step_time(n, total, longest)
        if step is None:
            return binds
        if not binds and step * (1 + self.tpot_margin) <= tpot:
            return False                   # everyone decodes within the tightest TPOT target
        if model is None:
            return True                    # no model to predict the padding saving with
        uniform = self._step_time(n, total, -(-total // n))
        return step - uniform >= self.tpot_margin * step     # the padding alignment can save

    def _to_continuous(self, now: float) -> None:
        """Leave aligned mode: pooled requests queue (oldest first) to be swapped in as memory
        allows, by :class:`DecodeScheduler`'s own swap-in rule."""
        self.aligning = False
        self.current = None
        pooled = [*self.cand_reqs, *self.cand_batch]
        entries = sorted(self.tree.iter_entries(), key=lambda e: (e.since, e.request_id))
        pooled += [self._from_tree(e.request_id, now) for e in entries]
        self.cand_reqs, self.cand_batch, self.cand_info = [], [], None
        for req in pooled:
            self.stager.unstage(req)
            req.policy_state.aligned_batch = None
            req.phase = Phase.SWAPPED
            self.swapped.append(req)

    def _to_aligned(self, plan: StepPlan, now: float) -> None:
        """Enter aligned mode: device-resident waiting requests join the running set while it has
        slots (they hold their blocks; case 3 evicts if needed) up to ``n_min`` (what an
        unaligned batch may fill: the under-filled rule), the rest are evicted to the pool;
        swapped ones go to the quad-tree. The running set is no aligned batch, so the first
        candidate batch forms at once (:meth:`_undersaturated`) and the switch rule replaces it."""
        self.aligning = True
        cap = min(self.n_min, self.max_batch_size)
        while self.waiting and len(self.running) < cap:
            self._admit(self.waiting.popleft(), now)
        while self.waiting:
            self._evict(self.waiting.popleft(), plan, now)
        while self.swapped:
            req = self.swapped.popleft()
            self._to_tree(req, _since(req, now))

    def _continuous_step(self, now: float) -> StepPlan | None:
        plan = self._prepare_step(now)
        self._recomputing = {c.request.request_id for c in plan.prefills}
        plan.decodes = list(self.running)
        for req in plan.decodes:
            if req.times.decode_start is None:
                req.times.decode_start = now
        return None if plan.is_empty else plan

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        if result.completed and plan.decodes and not (plan.prefills or plan.swap_in or plan.swap_out):
            self._last_step = (len(plan.decodes), result.duration)
        return super().update(plan, result, now)

    # ---- the guard's running figures follow every request held ------------------------------
    def add_request(self, req: Request, now: float) -> None:
        super().add_request(req, now)
        if self._held is not None:
            self._held.hold(req)

    def release(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        if req is not None and self._held is not None:
            self._held.forget(req)
        super().release(request_id)

    def abort(self, request_id: int, now: float, reason: str = "abort") -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and self._held is not None:
            self._held.forget(req)
        return super().abort(request_id, now, reason)

    def _advance_decode(self, req: Request, sampled: dict[int, int] | None,
                        stop_hit: set[int] | None, now: float, outcome: StepOutcome) -> None:
        super()._advance_decode(req, sampled, stop_hit, now, outcome)
        if self._held is not None and req.request_id in self.requests:   # (not aborted mid-step)
            self._held.grew(req)

    # ---- arrival: the KV lands in the host pool --------------------------------------------
    def can_reserve(self, req: Request) -> bool:
        if not self.aligning:
            return super().can_reserve(req)
        return self.pool.can_admit(req.request_id, req.context_len)

    def reserve(self, req: Request) -> list[int]:
        if not self.aligning:
            return super().reserve(req)
        return self.pool.allocate(req.request_id, req.context_len)

    def _enqueue(self, req: Request, now: float) -> None:
        req.phase = Phase.DECODE_WAITING
        if req.request_id in self.kv.tables:        # reserved on the device (continuous mode)
            self.waiting.append(req)
        elif self.aligning:
            self._to_tree(req, now)
        else:
            req.phase = Phase.SWAPPED
            self.swapped.append(req)

    def _to_tree(self, req: Request, since: float) -> None:
        req.policy_state.aligned_since = since
        req.policy_state.aligned_batch = None
        self.tree.insert(req.request_id, req.context_len, self.pool.num_allocated(req.request_id), since)

    def _from_tree(self, request_id: int, now: float) -> Request:
        entry = self.tree.remove(request_id)
        self.stats.pool_waits.append(now - entry.since)
        return self.requests[request_id]

    # ---- queues ----------------------------------------------------------------------------
    def _remove(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.tree:
            self.tree.remove(rid)
        for q in (self.cand_batch, self.cand_reqs, self.running, self.waiting, self.swapped):
            if req in q:
                q.remove(req)
        if req in self.recompute:
            self.recompute.remove(req)
        self.stager.unstage(req)
        self.pool.free(rid)

    @property
    def num_waiting(self) -> int:
        return (len(self.tree) + len(self.cand_batch) + len(self.cand_reqs) + len(self.recompute)
                + len(self.waiting) + len(self.swapped))

    # ---- the iteration-end decision --------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        if self.guard:
            pays = self._alignment_pays()
            if not pays:
                if self.aligning:
                    self._to_continuous(now)
                return self._continuous_step(now)
        plan = StepPlan(label=self.name)
        if self.guard and (not self.aligning or self.waiting or self.swapped):
            self._to_aligned(plan, now)
        self._make_room(plan, now)                       # case 3
        if self.dynamic:
            self._dynamic_prefetch(now)
        self._prepare_candidate_batch(now)
        self._admit_candidates(plan, now)                # case 1
        if self.cand_batch and self._should_switch():
            self._switch(plan, now)                      # case 2
        self._readmit_parked(plan, now)                  # recompute fallback (pool full)
        self._recomputing = {c.request.request_id for c in plan.prefills}
        plan.decodes = list(self.running)
        return None if plan.is_empty else plan

    def _need_blocks(self, req: Request) -> int:
        have = self.kv.num_allocated(req.request_id)
        need = blocks_for(req.context_len, self.kv.block_size) - have
        return need if need > 0 else 0

    def _make_room(self, plan: StepPlan, now: float) -> None:
        """Every running request must hold its next token; evict the longest until they do."""
        running, kv = self.running, self.kv
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
        cur = self.current.batch_id if self.current else None
        old = [r for r in self.running if r.policy_state.aligned_batch != cur]
        return max(old or self.running, key=lambda r: (r.context_len, r.request_id))

    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        rid, tokens = req.request_id, req.num_computed_tokens
        self.num_preemptions += 1
        req.num_preemptions += 1
        self.stats.evictions += 1
        if not self.pool.can_admit(rid, tokens):      # host pool full: drop and recompute
            self.stats.recomputes += 1
            self.kv.free(rid)
            req.num_computed_tokens = 0
            req.phase = Phase.DECODE_WAITING
            self.recompute.append(req)
            return
        plan.swap_out.append(self.pool.swap_out(self.kv, rid, tokens))
        self.stats.swap_out_tokens += tokens
        req.phase = Phase.SWAPPED
        if self.current is not None and req.policy_state.aligned_batch == self.current.batch_id:
            self.cand_reqs.append(req)                # evicted to the peer GPU buffer: staged now
            if self.prefetch:
                self.stager.stage(req, tokens, now, immediate=True)
        else:                                         # old batch: back to the pool, keeping its timer
            self._to_tree(req, _since(req, now))

    def _dynamic_prefetch(self, now: float) -> None:
        cur = self.current
        if cur is None or cur.start_iter is None or (self.cand_info is not None and self.cand_info.starving):
            return
        room = self.prefetch_window - sum(1 for r in self.cand_reqs if r.policy_state.aligned_batch == cur.batch_id)
        if room <= 0 or not len(self.tree):
            return
        shift = self.iteration - cur.start_iter
        for entry in self.tree.in_range(cur.lo + shift, cur.hi + shift, room):
            if self.prefetch and not self.stager.can_stage(entry.length):
                break
            req = self._from_tree(entry.request_id, now)
            req.policy_state.aligned_batch = cur.batch_id
            if self.prefetch:
                self.stager.stage(req, req.num_computed_tokens, now)
            self.cand_reqs.append(req)
            self.stats.aligned_prefetches += 1

    def _prepare_candidate_batch(self, now: float) -> None:
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
            sel = tree.grow(leaf, self.threshold_blocks, self.n_min, self.max_batch_size, force_one=True)
            self.stats.starvation_log.append((now, now - oldest.since, oldest.request_id in sel.request_ids))
            self._form(sel, now, starving=True)
            return
        sel = tree.density_first(self.threshold_blocks, self.n_min, self.max_batch_size)
        if sel is None or (not sel.full and not self._undersaturated()):
            return
        self._form(sel, now, starving=False)

    def _undersaturated(self) -> bool:
        if self.guard and self.current is None and self.running:
            return True                               # left from continuous mode: not aligned
        cur = self.current.batch_id if self.current else None
        queued = sum(1 for r in self.cand_reqs if r.policy_state.aligned_batch == cur)
        return len(self.running) + queued < self.n_min

    def _form(self, sel: Selection, now: float, *, starving: bool) -> None:
        if not sel.request_ids:
            return
        info = AlignedBatch(self._next_batch_id, sel.lo, sel.hi, len(sel), now, sel.full, starving)
        self._next_batch_id += 1
        batch = []
        for rid in sel.request_ids:
            req = self._from_tree(rid, now)
            req.policy_state.aligned_batch = info.batch_id
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
        need = blocks_for(req.context_len, self.kv.block_size)
        reserve = self.headroom_blocks if self.running else 0
        return need + reserve <= self.kv.num_free_blocks

    def _admit_candidates(self, plan: StepPlan, now: float) -> None:
        """Case 1: candidate requests of the running batch join while slots and memory allow."""
        cur = self.current.batch_id if self.current else None
        keep: list[Request] = []
        blocked = False
        for req in self.cand_reqs:
            if blocked or req.policy_state.aligned_batch != cur:
                keep.append(req)
                continue
            if len(self.running) >= self.max_batch_size or not self._fits(req):
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
        rid = req.request_id
        plan.swap_in.append(self.pool.swap_in(self.kv, rid, req.num_computed_tokens))
        self.kv.allocate(rid, req.context_len)
        self.stats.swap_in_tokens += req.num_computed_tokens
        self.stager.unstage(req)
        req.phase = Phase.DECODING
        if req.times.decode_start is None:
            req.times.decode_start = now
        self.running.append(req)

    def _should_switch(self) -> bool:
        cur = self.current.batch_id if self.current else None
        if any(r.policy_state.aligned_batch == cur for r in self.cand_reqs):
            return False                              # case 1 still has requests of this batch
        if self.current is None or not self.running:
            return True
        # the running batch no longer saturates the GPU: below n_min, or (a batch formed
        # smaller than n_min: starvation, memory-bound long requests) below half its peak
        members = sum(1 for r in self.running if r.policy_state.aligned_batch == cur)
        return members < min(self.n_min, (self.current.peak + 1) // 2)

    def _switch(self, plan: StepPlan, now: float) -> None:
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
        old = [r for r in self.running if r.policy_state.aligned_batch != info.batch_id]
        if old and self.switch_evict == "all" and (info.full or info.starving):
            lo, hi = info.lo, info.hi
            for req in old:
                if lo <= req.context_len <= hi:       # aligned with the new batch: it stays
                    req.policy_state.aligned_batch = info.batch_id
                else:
                    self.running.remove(req)
                    self._evict(req, plan, now)
        elif old and self.switch_evict in ("all", "memory"):
            need = sum(blocks_for(r.context_len, self.kv.block_size) for r in self.cand_reqs)
            need += self.headroom_blocks
            old.sort(key=lambda r: (r.context_len, r.request_id))
            while need > self.kv.num_free_blocks and old:
                victim = old.pop()                    # the longest of the old batch
                self.running.remove(victim)
                self._evict(victim, plan, now)
        self._admit_candidates(plan, now)

    def next_wakeup(self) -> float | None:
        if self.running:
            return None
        ready = [self.stager.ready_at(r) for r in self.cand_reqs]
        return min(ready) if ready else None

    # ---- after the step --------------------------------------------------------------------
    def _after_update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        super()._after_update(plan, outcome, now)
        self._recomputing = set()
        cur = self.current
        if cur is not None:
            members = sum(1 for r in self.running if r.policy_state.aligned_batch == cur.batch_id)
            cur.peak = max(cur.peak, members)
        if plan.decodes:
            self.iteration += 1
            self.stats.decode_steps += 1
            first = plan.decodes[0].policy_state.aligned_batch
            if any(r.policy_state.aligned_batch != first for r in plan.decodes):
                self.stats.mixed_steps += 1

    # ---- checking (tests) ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every request's KV lives in exactly one tier: device (running, waiting, or reserved for
        a transfer in flight), host pool (tree, buffers, swapped), or nowhere (recompute); block
        counts match the managers."""
        self.tree.check()
        kv, pool = self.kv, self.pool
        device = {r.request_id for r in (*self.running, *self.waiting)} | self._recomputing
        host = {*(r.request_id for r in (*self.cand_batch, *self.cand_reqs, *self.swapped))}
        host_tree = set(self.tree._entries)
        assert not (host & host_tree) and not (device & (host | host_tree)), "request in two places"
        in_flight = set(kv.tables) - device         # reserved for a transfer not yet arrived
        assert device <= set(kv.tables) and not (in_flight & set(self.requests)), \
            (sorted(kv.tables), sorted(device))
        assert set(pool.tables) >= host | host_tree
        assert kv.allocator.num_used == sum(len(t) for t in kv.tables.values())
        assert pool.allocator.num_used == sum(len(t) for t in pool.tables.values())
        for rid in host_tree:
            assert self.tree.entry(rid).blocks == pool.num_allocated(rid)
        if self._held is not None:                  # the guard's running figures match a scan
            reqs, held = list(self.requests.values()), self._held
            assert held.blocks == sum(blocks_for(r.context_len + 1, kv.block_size) for r in reqs)
            assert held.context == sum(r.context_len for r in reqs)
            assert held.longest(reqs) == max((r.context_len for r in reqs), default=0)
            assert held.min_tpot() == min((r.slo.tpot for r in reqs if r.slo.tpot is not None), default=None)
