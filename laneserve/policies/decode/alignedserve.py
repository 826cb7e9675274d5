"""AlignedServe decode: prefix-length-aligned batches from a host KV pool (AlignedServe §3.2–3.5).

Finished prefills land in the instance's :class:`~laneserve.core.kv.HostKVPool` (``reserve``
allocates host blocks; ``kv_lands_in_host`` tells the engine cluster to import there) and wait,
indexed by KV length in a :class:`KVLengthQuadTree`. Density-first search (§3.3) turns a subtree
into the **candidate batch**, which is staged (prefetched) while the running batch decodes
(:mod:`.mechanisms.aligned_prefetch`). At each iteration end, batch-level scheduling (§3.4, Algorithm 2):

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

Choices where the paper is silent are documented here and in :mod:`.mechanisms.quadtree`: the window rule,
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
replaces it at once (otherwise the mixed batch lingers and costs decode throughput; the figures:
docs/design.md, "AlignedServe: what was measured"). The guard reads running
figures (:mod:`.mechanisms.aligned_guard`) kept as requests arrive, decode and leave, so a
decision costs O(1) however many requests are held (the longest context is rescanned only after the longest request
left, and only with a padding cost model).
``alignedserve-literal`` (``guard=False``) is the paper's algorithm, used by
``benchmarks/decode_alignedserve.py``.

Composition: the mechanism lives in components that ``adaptive`` decode holds too, so this class
is only their wiring under :class:`~.base.DecodeScheduler` — ``self.aligner``
(:class:`~.mechanisms.aligner.LengthAligner`: the quad-tree, host-pool parking, candidate batches, staging,
the iteration-end decision) and, with ``guard=True``, the aligner's
:class:`~.mechanisms.aligned_guard.AlignmentGuard`.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import StepPlan
from laneserve.policies.decode.mechanisms.aligned_guard import AlignmentGuard
from laneserve.policies.decode.mechanisms.aligned_prefetch import PrefetchStager
from laneserve.policies.decode.mechanisms.aligner import AlignedWiring, AlignmentOptions, LengthAligner
from laneserve.policies.decode.base import DecodeScheduler
from laneserve.policies.registry import register


@dataclass(frozen=True, slots=True)
class AlignedServeOptions(AlignmentOptions):
    """AlignedServe's options: the aligner's and its guard's
    (:class:`~.mechanisms.aligner.AlignmentOptions`)."""


@register("decode", "alignedserve", aliases={"aligned": {}, "alignedserve-nop": {"prefetch": False, "guard": False},
                                             "alignedserve-literal": {"guard": False}})
class AlignedServeDecode(AlignedWiring, DecodeScheduler):
    name = "alignedserve"
    needs_host_pool = True
    can_align = True

    Options = AlignedServeOptions
    options: AlignedServeOptions
    #: the guard's class (tests swap in one that scans every request)
    guard_class: type[AlignmentGuard] = AlignmentGuard

    def __init__(self, kv: KVCacheManager, options: AlignedServeOptions | None = None, *,
                 host_pool: HostKVPool | None = None, **opts) -> None:
        if host_pool is None:
            raise ValueError("alignedserve needs a host KV pool (ClusterConfig.host_kv_tokens / "
                             "EngineConfig.num_host_blocks)")
        super().__init__(kv, options, host_pool=host_pool, **opts)
        o = self.options
        guard = self.guard_class(kv.block_size, can_align=True, tpot_margin=o.tpot_margin,
                                 cb_memory_fraction=o.cb_memory_fraction,
                                 align_memory_fraction=o.align_memory_fraction) if o.guard else None
        self.aligner = LengthAligner(self, o, host_pool, guard)

    # ---- the aligner's state, as the scheduler's (tests, benchmarks; the rest: AlignedWiring) --
    @property
    def stager(self) -> PrefetchStager:
        return self.aligner.stager

    def bind_cost_model(self, cost_model) -> None:
        self.aligner.bind_cost_model(cost_model)

    @property
    def stable_decode_batch(self) -> bool:      # type: ignore[override]
        """Guarded on a ragged kernel, the policy is continuous batching for good (and keeps no
        guard figures, so a simulator may run its stable batches as one event)."""
        return self.aligner.never_aligns

    def _continuous_step(self, now: float) -> StepPlan | None:
        return self.aligner.continuous_step(now)

