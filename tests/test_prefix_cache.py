"""Per-instance prefix caches: block naming, LRU eviction, reuse on the instance that prefilled a
history, cache-aware routing and LAPS pool affinity in the simulator."""

import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepResult
from laneserve.core.prefix_cache import PrefixCache, prefix_blocks
from laneserve.core.request import Request
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies import make
from laneserve.policies.routing import CacheAwareRouter
from laneserve.sim import ClusterConfig, Simulator

COST = LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01, decode_per_context_token=1e-7,
                       kv_capacity=400_000)


def blocks(*names, n=64):
    return tuple((name, n) for name in names)


def test_block_names_from_hash_ids_sessions_or_nothing():
    mooncake = Request(0, 0.0, 1300, 1, SLO(1.0), hash_ids=(7, 8, 9))
    assert prefix_blocks(mooncake) == ((("h", 7), 512), (("h", 8), 512))      # partial last block dropped
    turn = Request(1, 0.0, 200, 1, SLO(1.0), session_id=5, prefix_len=150)
    assert prefix_blocks(turn) == tuple((("s", 5, i), 64) for i in range(3))
    assert prefix_blocks(Request(2, 0.0, 5000, 1, SLO(1.0))) == ()
    spec = RequestSpec(3, 0.0, 130, 1, session_id=1)
    assert len(prefix_blocks(spec)) == 2


def test_match_is_the_leading_run_and_eviction_trims_chain_tails_first():
    cache = PrefixCache(capacity_tokens=5 * 64)
    cache.insert(blocks("a0", "a1", "a2"))
    assert cache.match(blocks("a0", "a1", "x", "a2")) == 128       # stops at the first miss
    assert cache.match(blocks("x", "a0")) == 0
    cache.insert(blocks("b0", "b1", "b2"))                           # 6 blocks > 5: evict one
    assert cache.used_tokens == 5 * 64 and cache.evicted_tokens == 64
    assert "a2" not in cache and "a0" in cache and "a1" in cache     # the older chain's tail goes first
    cache.match(blocks("a0", "a1"), touch=True)                      # chain a is now the most recent
    cache.insert(blocks("c0", "c1"))
    assert "a0" in cache and "a1" in cache and "b0" in cache
    assert "b2" not in cache and "b1" not in cache


def test_capacity_zero_holds_nothing_and_negative_is_rejected():
    cache = PrefixCache(0)
    cache.insert(blocks("a", "b"))
    assert len(cache) == 0 and cache.match(blocks("a")) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


def _run_one(sched, req, now=0.0):
    sched.add_request(req, now)
    plan = sched.schedule(now)
    assert plan is not None
    sched.update(plan, StepResult(duration=0.01, completed=True), now + 0.01)
    sched.release(req.request_id)
    return plan


def test_scheduler_reuses_only_what_its_own_cache_holds():
    kv = lambda: KVCacheManager(4096, 16)  # noqa: E731
    a = make("prefill", "fcfs", kv(), prefix_caching=True)
    b = make("prefill", "fcfs", kv(), prefix_caching=True)
    a.bind_prefix_cache(PrefixCache(100_000))
    b.bind_prefix_cache(PrefixCache(100_000))
    first = Request(0, 0.0, 300, 1, SLO(1.0), session_id=9)
    _run_one(a, first)
    assert first.num_cached_tokens == 0
    second_a = Request(1, 1.0, 500, 1, SLO(1.0), session_id=9, prefix_len=320)
    plan = _run_one(a, second_a, 1.0)
    assert second_a.num_cached_tokens == 256                         # 4 full blocks of the 300-token turn
    assert plan.prefills[0].num_new_tokens == 500 - 256
    second_b = Request(2, 1.0, 500, 1, SLO(1.0), session_id=9, prefix_len=320)
    _run_one(b, second_b, 1.0)
    assert second_b.num_cached_tokens == 0                           # instance b never saw the session
    assert a.prefix_cache.hit_tokens == 256 and a.prefix_cache.lookups == 2
    # without a bound cache the old idealisation holds: prefix_len counts as cached anywhere
    c = make("prefill", "fcfs", kv(), prefix_caching=True)
    ideal = Request(3, 0.0, 500, 1, SLO(1.0), session_id=9, prefix_len=320)
    _run_one(c, ideal)
    assert ideal.num_cached_tokens == 320


def test_laps_classifies_by_the_cache_it_has():
    s = make("prefill", "laps", KVCacheManager(4096, 16), prefix_caching=True)
    s.bind_prefix_cache(PrefixCache(100_000))
    turn2 = Request(1, 0.0, 2100, 1, SLO(0.4), session_id=3, prefix_len=2000)
    assert s.new_tokens(turn2) == 2100                               # history not held here: long
    s.prefix_cache.insert(prefix_blocks(Request(0, 0.0, 2000, 1, SLO(0.4), session_id=3)))
    turn2b = Request(2, 0.0, 2100, 1, SLO(0.4), session_id=3, prefix_len=2000)
    assert s.new_tokens(turn2b) == 2100 - 1984                       # 31 full blocks held: short


def sessions(n_sessions=60, turns=5, rate=4.0, seed=0):
    rng = random.Random(seed)
    specs, rid, t0 = [], 0, 0.0
    for sid in range(n_sessions):
        t0 += rng.expovariate(rate / turns)
        t, history = t0, 0
        for turn in range(turns):
            new = rng.randint(20, 200)
            out = rng.randint(1, 8)
            specs.append(RequestSpec(rid, t, history + new, out, slo=SLO(0.4, 0.1), prefix_len=history,
                                     session_id=sid, turn=turn))
            rid += 1
            history += new + out
            t += rng.expovariate(1.0)
    specs.sort(key=lambda s: s.arrival_time)
    return [RequestSpec(i, s.arrival_time, s.prompt_len, s.output_len, slo=s.slo, prefix_len=s.prefix_len,
                        session_id=s.session_id, turn=s.turn) for i, s in enumerate(specs)]


def _prefilled_tokens(result):
    return sum(r.prompt_len - r.num_cached_tokens for r in result.requests)


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "cache-aware",
                                    "laps-pools:period=0.5,cool_down=1"])
def test_sim_with_instance_caches_serves_everyone_and_reuses_only_real_hits(router):
    specs = sessions()
    policy = "laps:mode=spatial" if router.startswith("laps") else "fcfs"
    cfg = ClusterConfig(num_prefill=4, num_decode=1, prefill_policy=policy, router=router,
                        prefill_opts={"prefix_caching": True}, prefix_cache_tokens=0)
    sim = Simulator(cfg, COST)
    res = sim.run(specs)
    assert res.unfinished == 0 and sorted(r.request_id for r in res.requests) == list(range(len(specs)))
    for r in res.requests:
        assert 0 <= r.num_cached_tokens <= min(r.prefix_len, r.prompt_len - 1)   # reuse never exceeds history
    for inst in sim.front:
        assert inst.scheduler.kv.num_free_blocks == inst.scheduler.kv.num_blocks
    stats = [s for s in res.instances if s["role"] == "prefill"]
    assert all("prefix_hit_rate" in s for s in stats)


def test_cache_aware_routing_recomputes_less_than_round_robin_and_ideal_is_a_lower_bound():
    specs = sessions()
    def run(router, cache):
        cfg = ClusterConfig(num_prefill=4, num_decode=1, router=router, prefill_opts={"prefix_caching": True},
                            prefix_cache_tokens=cache)
        return Simulator(cfg, COST).run(specs)
    rr, aware, ideal = run("round-robin", 0), run("cache-aware", 0), run("round-robin", None)
    assert _prefilled_tokens(ideal) < _prefilled_tokens(aware) < _prefilled_tokens(rr)
    hits = lambda res: sum(r.num_cached_tokens for r in res.requests)  # noqa: E731
    reachable = sum(min(s.prefix_len, s.prompt_len - 1) // 64 * 64 for s in specs)   # full history blocks
    assert hits(aware) > 2 * hits(rr)
    assert hits(aware) >= 0.85 * reachable and hits(rr) <= 0.5 * reachable


def test_laps_pool_affinity_changes_nothing_under_idealised_caching():
    specs = sessions(seed=2)
    def violations(router):
        cfg = ClusterConfig(num_prefill=4, num_decode=1, prefill_policy="laps:mode=spatial", router=router,
                            prefill_opts={"prefix_caching": True})
        res = Simulator(cfg, COST).run(specs)
        return [(r.request_id, r.prefill_instance, r.times.first_token) for r in res.requests]
    assert violations("laps-pools:period=0.5") == violations("laps-pools:period=0.5,affinity=false")


class Inst:
    role = "prefill"
    accepting = True
    num_waiting = 0
    num_running = 0
    kv_usage = 0.0

    def __init__(self, i, queued, hit):
        self.instance_id, self.queued_tokens, self.hit = i, queued, hit

    def cached_prefix(self, req):
        return self.hit


def test_cache_aware_router_prefers_the_holder_unless_it_is_overloaded():
    r = Request(0, 0.0, 1000, 1, SLO(1.0))
    router = CacheAwareRouter(threshold=0.5, balance_tokens=1000)
    assert router.route(r, [Inst(0, 0, 0), Inst(1, 500, 900), Inst(2, 100, 0)], 0.0) == 1
    assert router.route(r, [Inst(0, 0, 0), Inst(1, 5000, 900), Inst(2, 100, 0)], 0.0) == 0   # too loaded
    assert router.route(r, [Inst(0, 50, 0), Inst(1, 500, 400), Inst(2, 10, 0)], 0.0) == 2    # below threshold
    assert router.affinity_picks == 1
    with pytest.raises(ValueError):
        CacheAwareRouter(threshold=1.5)


def test_engine_instances_refuse_prefix_caching_they_cannot_honour():
    from laneserve.engine.instance import EngineInstance
    kv = KVCacheManager(256, 16)
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineInstance(make("prefill", "fcfs", kv, prefix_caching=True), executor=None)
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineInstance(make("colocated", "colocated", kv, prefix_caching=True), executor=None)
    assert EngineInstance(make("prefill", "fcfs", kv), executor=None).role == "prefill"
