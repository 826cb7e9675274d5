"""AlignedServe decode (§3): quad-tree counters, density-first search, KV conservation across
device / host pool / transfer, every request finishing, the starvation bound, rare batch switches,
and greedy tokens on the engine equal to continuous batching's."""

import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies import make
from laneserve.core.kv import blocks_for
from laneserve.policies.decode.mechanisms.aligned_guard import AlignmentGuard, contexts
from laneserve.policies.decode.mechanisms.aligned_stats import Aligned
from laneserve.policies.decode.mechanisms.aligner import LengthAligner
from laneserve.policies.decode.alignedserve import AlignedServeDecode
from laneserve.policies.decode.mechanisms.quadtree import KVLengthQuadTree
from laneserve.policies.registry import register
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload


# ---- quad-tree -----------------------------------------------------------------------------
def test_quadtree_counters_stay_consistent_under_random_insert_remove_grow():
    rng = random.Random(7)
    tree = KVLengthQuadTree(leaf_width=16)
    live: dict[int, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not live:
            rid = step
            length = rng.choice([rng.randint(1, 300), rng.randint(1, 70000)])
            tree.insert(rid, length, -(-length // 16), since=rng.random() * 100)
            live[rid] = length
        elif op < 0.75:
            rid = rng.choice(list(live))
            tree.remove(rid)
            del live[rid]
        else:
            rid = rng.choice(list(live))
            live[rid] += rng.randint(1, 40)
            tree.update(rid, live[rid], -(-live[rid] // 16))
        if step % 100 == 0:
            tree.check()
    tree.check()
    assert len(tree) == len(live)
    assert tree.root.num_blocks == sum(-(-n // 16) for n in live.values())
    assert {e.request_id for e in tree.in_range(1, 65536, 10**6)} == set(live)
    over = [rid for rid, n in live.items() if n > 65536]
    for rid in over:
        assert tree.entry(rid).length == 65536        # longer than the range counts as 65536


def _tree(groups, leaf_width=64):
    tree = KVLengthQuadTree(leaf_width=leaf_width)
    rid = 0
    for length, count, blocks in groups:
        for _ in range(count):
            tree.insert(rid, length, blocks, since=float(rid))
            rid += 1
    return tree


def test_density_first_finds_the_dense_tight_cluster_within_threshold():
    rng = random.Random(1)
    tree = KVLengthQuadTree()
    for rid in range(400):   # sparse background over the whole range plus a dense cluster
        length = rng.randint(300, 330) if rid < 120 else rng.randint(1, 60000)
        tree.insert(rid, length, -(-length // 16), since=0.0)
    threshold = 3000
    sel = tree.density_first(threshold, n_min=36, max_requests=256)
    assert sel.full and len(sel) >= 36 and sel.blocks <= threshold
    # case 2 descended root -> [1,16384] -> [1,4096] (over the threshold) -> [1,1024]: case 1
    # takes that whole subtree, the cluster and the few background requests inside it
    inside = {e.request_id for e in tree.in_range(1, 1024, 10**6)}
    assert set(sel.request_ids) == inside and set(range(120)) <= inside


def test_density_first_descends_into_the_child_with_most_requests():
    # root too big: [1,16384] holds most requests but too many blocks; the densest leaf wins
    tree = _tree([(100, 50, 6), (700, 40, 6), (5000, 10, 300), (30000, 5, 2000)])
    sel = tree.density_first(threshold_blocks=400, n_min=36, max_requests=256)
    assert sel.full and {tree.entry(r).length for r in sel.request_ids} == {100}


def test_widening_searches_left_siblings_right_to_left_then_right_ones():
    # leaves of width 64 under [1,256]: L1 empty, L2 5, L3 15 (the densest), L4 14; one block each
    tree = _tree([(100, 5, 1), (150, 15, 1), (200 + 0, 7, 1), (230, 7, 1)])
    sel = tree.density_first(threshold_blocks=30, n_min=30, max_requests=256)
    lengths = sorted(tree.entry(r).length for r in sel.request_ids)
    assert sel.full and len(sel) == 30 and sel.blocks <= 30
    # L3 whole, then L2 (left, nearest first), then the nearest end of L4
    assert lengths.count(150) == 15 and lengths.count(100) == 5
    assert lengths.count(200) == 7 and lengths.count(230) == 3


def test_widening_takes_the_nearest_end_of_a_sibling_that_does_not_fit():
    # seed leaf [129,192] (22); its left sibling [65,128] (10) does not fit the 8 blocks left
    tree = _tree([(70, 5, 1), (120, 5, 1), (150, 22, 1), (250, 5, 1)])
    sel = tree.density_first(threshold_blocks=30, n_min=30, max_requests=256)
    lengths = sorted(tree.entry(r).length for r in sel.request_ids)
    assert lengths == [70] * 3 + [120] * 5 + [150] * 22   # entered from its high (nearest) end


def test_search_reports_an_underfilled_batch_when_n_min_is_impossible():
    tree = _tree([(100, 5, 1), (9000, 3, 600)])
    sel = tree.density_first(threshold_blocks=100, n_min=36, max_requests=256)
    assert not sel.full and 1 <= len(sel) <= 8 and sel.blocks <= 100


# ---- the scheduler in the simulator ----------------------------------------------------------
def check_aligner_invariants(self: LengthAligner) -> None:
    """A length aligner's bookkeeping, by a full scan: every request's KV lives in exactly one
    tier: device (running, waiting, or reserved for a transfer in flight), host pool (tree,
    buffers, swapped), or nowhere (recompute); block counts match the managers."""
    h = self.host
    self.tree.check()
    kv, pool = h.kv, self.pool
    device = {r.request_id for r in (*h.running, *h.waiting)} | self._recomputing
    host = {*(r.request_id for r in (*self.cand_batch, *self.cand_reqs, *h.swapped))}
    host_tree = set(self.tree._entries)
    assert not (host & host_tree) and not (device & (host | host_tree)), "request in two places"
    in_flight = set(kv.tables) - device         # reserved for a transfer not yet arrived
    assert device <= set(kv.tables) and not (in_flight & set(h.requests)), \
        (sorted(kv.tables), sorted(device))
    assert set(pool.tables) >= host | host_tree
    assert kv.allocator.num_used == sum(len(t) for t in kv.tables.values())
    assert pool.allocator.num_used == sum(len(t) for t in pool.tables.values())
    for rid in host_tree:
        assert self.tree.entry(rid).blocks == pool.num_allocated(rid)
    held = self.guard.held if self.guard is not None else None
    if held is not None:                        # the guard's running figures match a scan
        reqs = list(h.requests.values())
        assert held.blocks == sum(blocks_for(r.context_len + 1, kv.block_size) for r in reqs)
        assert held.context == sum(r.context_len for r in reqs)
        assert held.longest(reqs) == max((r.context_len for r in reqs), default=0)
        assert held.min_tpot() == min((r.slo.tpot for r in reqs if r.slo.tpot is not None), default=None)


@register("decode", "alignedserve-checked")
class CheckedAlignedServe(AlignedServeDecode):
    """AlignedServe that checks its KV invariants after every decision and every step."""

    def schedule(self, now):
        plan = super().schedule(now)
        check_aligner_invariants(self.aligner)
        return plan

    def _after_update(self, plan, outcome, now):
        super()._after_update(plan, outcome, now)
        check_aligner_invariants(self.aligner)


COST = LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01, decode_per_context_token=1e-7,
                       kv_capacity=200_000, attention="padded")


def random_specs(n, seed, rate=20.0, long_share=0.1):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = rng.randint(1000, 6000) if rng.random() < long_share else rng.randint(10, 600)
        out.append(RequestSpec(i, t, prompt, rng.randint(1, 300), slo=SLO(5.0, 0.2)))
    return out


@pytest.mark.parametrize("seed,opts,device,host", [
    (0, {}, 24_000, 400_000),
    (1, {"prefetch": False, "switch_evict": "memory"}, 24_000, 400_000),
    (2, {"n_min": 4, "threshold": 0.2, "starvation_bound": 2.0, "prefetch_tokens_per_s": 2e5}, 24_000, 400_000),
    (3, {"switch_evict": "none", "threshold": 0.9}, 10_000, 25_000),      # pool full: recompute
    (4, {"guard": True}, 24_000, 400_000),     # the guard switches between aligned and continuous
])
def test_kv_conserved_and_every_request_finishes(seed, opts, device, host):
    specs = random_specs(250, seed, rate=100.0)
    cfg = ClusterConfig(num_prefill=2, decode_policy="alignedserve-checked", decode_kv_tokens=device,
                        host_kv_tokens=host, swap_link="nvlink",
                        decode_opts={"n_min": 8, "threshold": 0.8, "guard": False, **opts})
    sim = Simulator(cfg, COST)
    res = sim.run(specs)
    assert res.unfinished == 0
    for r in res.requests:
        assert r.finish_reason == "length" and r.num_output_tokens == r.max_output_tokens
    sched = sim.back[0].scheduler
    assert sched.stats.evictions > 0                   # memory pressure exercised eviction
    assert (sched.stats.recomputes > 0) == (host < 100_000)
    if opts.get("guard"):
        assert not sched.swapped and not sched.waiting
    for kv in (sched.kv, sched.pool):
        assert kv.num_free_blocks == kv.num_blocks and not kv.tables
    al = sched.aligner
    assert not len(al.tree) and not al.cand_reqs and not al.cand_batch and not sched.running
    assert sched.stager.staged_tokens == 0


def test_spec_options_reach_the_policy():
    from laneserve.core.kv import HostKVPool, KVCacheManager
    pol = make("decode", "alignedserve:threshold=0.25,n_min=8,starvation_bound=5,prefetch=false",
               KVCacheManager(1000), host_pool=HostKVPool(4000))
    al = pol.aligner
    assert (al.threshold_blocks, al.n_min, al.starvation_bound, al.prefetch) == (250, 8, 5, False)
    with pytest.raises(ValueError, match="host KV pool"):
        make("decode", "alignedserve", KVCacheManager(1000))


def test_starvation_bound_gives_old_requests_the_next_batch():
    # a steady stream of aligned short requests keeps the GPU saturated; the rare long ones never
    # make n_min together, so without the bound they wait for the stream to thin out
    cost = LinearCostModel(prefill_per_token=2e-6, decode_fixed=0.004, decode_per_context_token=1e-8,
                           kv_capacity=200_000, attention="padded")
    rng = random.Random(5)
    specs, t = [], 0.0
    for i in range(800):
        t += rng.expovariate(60.0)
        prompt = rng.randint(3000, 4000) if i % 50 == 7 else rng.randint(100, 400)
        specs.append(RequestSpec(i, t, prompt, rng.randint(50, 200)))
    waits = {}
    for bound in (2.0, None):
        cfg = ClusterConfig(decode_policy="alignedserve-checked", decode_kv_tokens=40_000,
                            host_kv_tokens=1_000_000, swap_link="nvlink",
                            decode_opts={"n_min": 8, "starvation_bound": bound, "guard": False})
        sim = Simulator(cfg, cost)
        res = sim.run(specs)
        assert res.unfinished == 0
        st = sim.back[0].scheduler.stats
        waits[bound] = max(st.pool_waits)
        if bound is not None:
            assert st.starvation_batches > 0
            # every batch formed while a request had waited past the bound included the oldest
            assert st.starvation_log and all(included for _, _, included in st.starvation_log)
            # so a wait exceeds the bound by at most the time its batch waited for the switch
            # (plus one decode step: decisions are taken at iteration ends)
            assert waits[bound] <= bound + max(st.starving_switch_delays) + 0.1
    assert waits[None] > 3 * waits[2.0]


def test_switch_iterations_are_rare_on_a_95_percent_short_mix():
    cost = make_cost_model("analytic", model="llama-2-7b", hardware="h100", attention="padded")
    w = make_workload("alignedserve_mix", n=400, short_ratio=0.95, rate=30.0, seed=3)
    pcie = 1e6 / cost.kv_transfer_time(10**6, "pcie")
    cfg = ClusterConfig(num_prefill=4, decode_policy="alignedserve-literal", host_kv_tokens=2_000_000,
                        swap_link="nvlink", decode_opts={"prefetch_tokens_per_s": pcie})
    sim = Simulator(cfg, cost)
    res = sim.run(w.specs)
    assert res.unfinished == 0
    st = sim.back[0].scheduler.stats
    assert st.full_batches >= 3 and st.switches >= 3
    assert st.switch_iteration_share <= 0.15


# ---- the engine --------------------------------------------------------------------------
def test_engine_alignedserve_greedy_tokens_equal_continuous_batching():
    from engine_support import hf_logits, prompts, tiny_checkpoint
    from laneserve.cluster import LocalCluster
    from laneserve.core import Request, SamplingParams
    from laneserve.engine import EngineConfig

    path = tiny_checkpoint("qwen3")
    lengths = [12, 50, 3, 70, 25, 9, 40, 66]
    ps = prompts(lengths, seed=4)
    outs = {}
    for policy in ("continuous", "alignedserve-literal:n_min=2,threshold=1.0,headroom=0"):
        reqs = [Request(i, 0.005 * i, len(p), 24, SLO(), prompt_token_ids=list(p),
                        sampling=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for i, p in enumerate(ps)]
        # 12 device blocks of 16 tokens: every KV goes through the host pool, and growing batches
        # may evict (swap out) and swap back in
        cluster = LocalCluster(path, decode_policy=policy, kv_tokens=192,
                               config=EngineConfig(num_threads=1, num_host_blocks=128))
        done = cluster.run(reqs, timeout=60)
        outs[policy] = {r.request_id: r.output_token_ids for r in done}
        assert len(outs[policy]) == len(ps)
        dec = cluster.decode[0].scheduler
        assert dec.kv.num_free_blocks == dec.kv.num_blocks
        if isinstance(dec, AlignedServeDecode):
            assert dec.pool.num_free_blocks == dec.pool.num_blocks
            assert dec.stats.swap_in_tokens >= sum(lengths)
    # the same greedy tokens, except where two runs part at a near-tie of the model's own logits
    # (batches of different shapes round fp32 sums differently; a wrong swap would part anywhere)
    aligned = outs["alignedserve-literal:n_min=2,threshold=1.0,headroom=0"]
    for rid, p in enumerate(ps):
        a, b = outs["continuous"][rid], aligned[rid]
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = hf_logits("qwen3", list(p) + a[:k])[-1].float().topk(2).values
        assert float(top2[0] - top2[1]) < 1e-3, f"request {rid} parts at token {k}, not at a near-tie"


# ---- the guard's running figures decide as a scan of every request would ---------------------
class PlanLog:
    """Records each plan's signature: who decodes, recomputes and swaps."""

    def schedule(self, now):
        plan = super().schedule(now)
        log = self.__dict__.setdefault("plans", [])
        log.append(None if plan is None else (
            now, tuple(r.request_id for r in plan.decodes), tuple((c.request.request_id, c.num_new_tokens)
                                                                 for c in plan.prefills),
            len(plan.swap_in), len(plan.swap_out), self.aligning))
        return plan


@register("decode", "alignedserve-logged")
class LoggedAlignedServe(PlanLog, CheckedAlignedServe):
    pass


class ScanGuard(AlignmentGuard):
    """The guard written straightforwardly: each decision scans every request held."""

    def pays(self, aligning, requests, kv):
        if self.never_aligns:
            return False
        reqs = list(requests.values())
        demand = sum(blocks_for(r.context_len + 1, kv.block_size) for r in reqs)
        limit = self.cb_memory_fraction if aligning else self.align_memory_fraction
        binds = demand > limit * kv.num_blocks
        targets = [r.slo.tpot for r in reqs if r.slo.tpot is not None]
        if not binds and not targets:
            return False
        ctx = [r.context_len for r in reqs]
        model = self.cost_model
        if not ctx:
            step = 0.0
        elif model is not None:
            step = model.decode_step_time(ctx)
        elif self.last_step is not None:
            step = self.last_step[1] * max(1.0, len(ctx) / self.last_step[0])
        else:
            return binds
        if not binds and step * (1 + self.tpot_margin) <= min(targets):
            return False
        if model is None:
            return True
        uniform = model.decode_step_time(contexts(len(ctx), sum(ctx), -(-sum(ctx) // len(ctx))))
        return step - uniform >= self.tpot_margin * step


@register("decode", "alignedserve-scan-guard")
class ScanGuardAlignedServe(PlanLog, AlignedServeDecode):
    """AlignedServe holding the scanning guard."""

    guard_class = ScanGuard


@pytest.mark.parametrize("seed,predictor,cost", [(0, "oracle", "padded"), (1, "online", "padded"),
                                                 (2, "oracle", "analytic-padded"), (3, "oracle", "ragged")])
def test_guard_figures_decide_like_a_scan_of_every_request(seed, predictor, cost):
    """Random loads with mixed TPOT targets (and none), decode memory that binds at times: the
    guarded policy on running figures and the scanning reference make the same plans, step for
    step, and the figures match a scan after every step."""
    model = {"padded": COST, "ragged": LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01,
                                                       decode_per_context_token=1e-7, kv_capacity=200_000),
             "analytic-padded": make_cost_model("analytic", model="llama-3-8b", hardware="h100",
                                                attention="padded")}[cost]
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(200):
        t += rng.expovariate(rng.choice((20.0, 150.0)))
        prompt = rng.randint(1000, 6000) if rng.random() < 0.15 else rng.randint(10, 600)
        specs.append(RequestSpec(i, t, prompt, rng.randint(1, 120),
                                 slo=SLO(5.0, rng.choice((0.02, 0.05, 0.2, None)))))
    logs = {}
    for policy in ("alignedserve-logged", "alignedserve-scan-guard"):
        cfg = ClusterConfig(num_prefill=2, decode_policy=policy, decode_kv_tokens=24_000, host_kv_tokens=400_000,
                            predictor=predictor, decode_opts={"n_min": 8, "threshold": 0.8})
        sim = Simulator(cfg, model)
        assert sim.run(specs).unfinished == 0
        logs[policy] = sim.back[0].scheduler.plans
    optimised, reference = logs["alignedserve-logged"], logs["alignedserve-scan-guard"]
    assert optimised == reference
    modes = {p[-1] for p in optimised if p is not None}
    assert modes == ({False} if cost == "ragged" else {False, True})    # both modes exercised


def _padded_with_arrivals(n: int, **opts) -> CheckedAlignedServe:
    """A guarded policy on the padded cost model in continuous mode with ``n`` prefilled requests
    arrived (alternately 20,000 and 100 prompt tokens) whose TPOT target no step meets."""
    from laneserve.core.kv import HostKVPool, KVCacheManager
    from laneserve.core.request import Phase, Request
    pol = CheckedAlignedServe(KVCacheManager(10_000, 16), host_pool=HostKVPool(20_000, 16), **opts)
    pol.bind_cost_model(COST)                       # padded
    for i in range(n):
        req = Request(i, 0.0, 100 if i % 2 else 20_000, 50, SLO(5.0, 0.001))
        req.num_computed_tokens = req.prompt_len
        req.record_token(0.0)
        req.phase = Phase.TRANSFERRING
        pol.reserve(req)
        pol.add_request(req, 0.0)
    return pol


def test_entering_aligned_mode_keeps_the_batch_cap_and_parks_the_rest():
    """Switching to aligned mode with more device-resident requests waiting than batch slots: the
    running set stays within ``max_batch_size``, the rest are swapped out into the length tree
    (one swap each, no quadratic eviction loop)."""
    pol = _padded_with_arrivals(10, max_batch_size=4)
    assert not pol.aligning and len(pol.waiting) == 10
    plan = pol.schedule(0.1)
    assert pol.aligning and len(pol.running) <= 4 and len(plan.decodes) <= 4
    assert not pol.waiting and len(plan.swap_out) >= 6
    al = pol.aligner
    assert len(al.tree) + len(al.cand_batch) + len(al.cand_reqs) + len(pol.running) == 10


def test_entering_aligned_mode_fills_only_an_unaligned_batch_and_aligns_at_once():
    """Requests left running (or waiting on the device) from continuous mode are no aligned batch:
    on entering aligned mode at most ``n_min`` of them run, and a length-aligned batch is formed
    and switched to in the same step instead of waiting for that mixed batch to drain."""
    pol = _padded_with_arrivals(12, max_batch_size=64, n_min=4)
    assert not pol.aligning and pol.aligner.current is None
    plan = pol.schedule(0.1)
    current = pol.aligner.current
    assert pol.aligning and current is not None          # an aligned batch runs now
    members = [r for r in pol.running if r.policy_state.of(Aligned).batch == current.batch_id]
    assert members and len(plan.swap_out) >= 12 - 4
    lengths = {r.context_len > 1_000 for r in members}
    assert len(lengths) == 1                                  # the batch is one length class
