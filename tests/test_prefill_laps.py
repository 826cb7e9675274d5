"""LAPS (laps.txt §2.1, §3): lanes by new tokens, AWD dispatch triggers, shape buckets,
deadline-free token-max, the spatial pool controller, and conservation in the simulator."""

import functools
import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepResult
from laneserve.core.request import Request
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies import make
from laneserve.policies.registry import resolve
from laneserve.policies.prefill.laps import LapsPrefill
from laneserve.core.shapes import ShapeGrid
from laneserve.policies.prefill.mechanisms.laps_awd import AdaptiveWaitDepth, AWDConfig
from laneserve.policies.prefill.mechanisms.laps_lanes import LONG, SHORT, LaneTag
from laneserve.policies.routing_laps import LapsPoolRouter, PoolController
from laneserve.measure.metrics import summarize
from laneserve.sim import ClusterConfig, Simulator

COST = LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01, decode_per_context_token=1e-7,
                       kv_capacity=400_000)
GRID = ShapeGrid()


def req(i, t, prompt, prefix=0, out=1, ttft=0.4):
    return Request(i, t, prompt, out, SLO(ttft, 0.1), prefix_len=prefix)


def sched(**opts) -> LapsPrefill:
    """The paper's algorithm (``laps-literal``): these tests pin Algorithm 1 and the alternation."""
    factory, preset = resolve("prefill", "laps-literal")
    return factory(KVCacheManager(4096, 16), **{**preset, **opts})


def drain(s: LapsPrefill, now=0.0, step=0.01, limit=10_000):
    """Run the scheduler alone (a fake executor: every step takes ``step`` s); returns the plans."""
    plans = []
    for _ in range(limit):
        plan = s.schedule(now)
        if plan is None:
            wake = s.next_wakeup()
            if wake is None:
                break
            now = max(now, wake)
            continue
        now += step
        out = s.update(plan, StepResult(duration=step), now)
        for r in out.prefilled + out.finished:
            s.release(r.request_id)
        plans.append(plan)
    return plans


def test_classification_counts_new_tokens_only():
    s = sched(prefix_caching=True)
    assert s.lane_of(req(0, 0, 2000, prefix=1900)) == SHORT        # re-prefill of 100 new tokens
    assert s.lane_of(req(1, 0, 300)) == LONG
    assert s.lane_of(req(2, 0, 255)) == SHORT
    assert sched(prefix_caching=False).lane_of(req(3, 0, 2000, prefix=1900)) == LONG
    assert sched(boundary=64, prefix_caching=True).lane_of(req(4, 0, 2000, prefix=1900)) == LONG
    router = LapsPoolRouter()
    assert router.classify(req(5, 0, 2000, prefix=1900)) == SHORT
    assert router.classify(req(6, 0, 2000)) == LONG


def test_shape_grid_nearest_shape_covers_the_batch():
    assert GRID.shape(5, 3) == (8, 4) and GRID.shape(129, 17) == (256, 32) and GRID.shape(300, 1) is None
    assert GRID.max_depth(2048) == 64 and GRID.max_depth(100) == 8
    for n in range(1, 65):
        for length in (1, 7, 8, 9, 100, 256):
            l_pad, b_pad = GRID.shape(length, n)
            assert l_pad >= length and b_pad >= n and l_pad in GRID.lengths and b_pad in GRID.batches


def test_lanes_never_mix_and_padded_shapes_are_grid_shapes():
    rng = random.Random(1)
    s = sched(prefix_caching=True, awd=True)
    reqs = []
    for i in range(300):
        prompt = rng.choice([rng.randint(1, 255), rng.randint(256, 3000)])
        prefix = rng.choice([0, 0, rng.randint(0, 2000)])
        reqs.append(req(i, i * 0.002, prompt + prefix, prefix=prefix))
    for r in reqs:
        s.add_request(r, r.arrival_time)
    plans = drain(s, now=reqs[-1].arrival_time)
    assert {r.request_id for p in plans for c in p.prefills for r in [c.request]} == set(range(300))
    for p in plans:
        lanes = {c.request.policy_state.of(LaneTag).lane for c in p.prefills}
        assert len(lanes) == 1
        if p.padded_shape is not None:
            length, batch = p.padded_shape
            assert lanes == {SHORT} and length in GRID.lengths and batch in GRID.batches
            assert batch >= len(p.prefills) and all(c.num_new_tokens <= length for c in p.prefills)
    assert all(r.prefill_done for r in reqs)
    assert s.steps[SHORT] > 0 and s.steps[LONG] > 0


def test_short_batch_groups_by_bucket_and_fills_padding_rows_with_smaller_ones():
    s = sched(awd=False)
    for i, n in enumerate([100, 120, 110, 10, 200, 5]):     # buckets 128,128,128,16,256,8
        s.add_request(req(i, 0.0, n), 0.0)
    plan = s.schedule(0.0)
    ids = [c.request.request_id for c in plan.prefills]
    assert plan.padded_shape == (128, 4)
    assert ids[:3] == [0, 1, 2] and ids[3] == 3         # 3 of bucket 128 + one smaller in the pad row
    assert 4 not in ids                                  # a larger bucket never raises L


def awd(**kw):
    """Algorithm 1 as printed (the light-load dispatch is tested on its own)."""
    return AdaptiveWaitDepth(AWDConfig(**{"light_load": False, **kw}), depth_cap=64)


def test_awd_dispatch_triggers():
    a = awd(w_min=0.0, w_max=0.05, t_max=0.5, sigma=0.01, service_init=0.01)
    a.on_arrival(0.0)
    a.depth_target = 4
    inf = float("inf")
    d = a.decide(0.0, 1, inf, 0.0, 10)
    assert not d.dispatch and 0 < d.wake_at <= 0.05                      # waiting inside the window
    assert a.decide(0.01, 4, inf, 0.0, 40).reason == "depth"               # depth D reached
    assert a.decide(0.05, 1, inf, 0.0, 10).reason == "window"              # window expiry
    assert a.decide(0.001, 1, 0.015, 0.0, 10).reason == "slack"            # DDL - (t + S) <= sigma
    b = awd(w_min=1.0, w_max=2.0, t_max=0.1)
    b.on_arrival(0.0)
    b.depth_target = 64
    assert b.decide(0.11, 2, inf, 0.0, 10).reason == "t_max"               # head-of-line wait


def test_awd_adapts_depth_and_window_to_the_fill():
    a = awd(w_max=0.05)
    a.on_arrival(0.0)
    a.depth_target = 16
    a.on_dispatch(0.05, 3, "window", queue_left=False)
    assert a.depth_target == 2                      # window expired first: D <- depth (grid floor)
    a.on_arrival(0.1)
    a.on_dispatch(0.11, 2, "depth", queue_left=False)
    assert a.depth_target == 4                      # depth reached: probe the next captured depth
    assert a.rate > 0


def test_awd_window_expiry_wakes_the_simulator():
    """One lonely short request: nothing but the wake-up at window expiry can dispatch it."""
    cfg = ClusterConfig(prefill_policy="laps-literal:w_min=0.05,w_max=0.05", num_decode=1)
    res = Simulator(cfg, COST).run([RequestSpec(0, 1.0, 32, 1, slo=SLO(10.0, 1.0))])
    r = res.requests[0]
    assert r.times.prefill_start == pytest.approx(1.05)
    assert r.times.first_token == pytest.approx(1.05 + COST.prefill_time([(32, 0)]))


def test_deadline_free_token_max():
    s = sched(deadline_free=True, short_tokens=400, w_max=10.0, t_max=10.0)
    for i in range(3):
        s.add_request(req(i, 0.0, 100, ttft=None), 0.0)
    assert s.schedule(0.0) is None and s.next_wakeup() == pytest.approx(10.0)   # 300 < M_s
    s.add_request(req(3, 0.1, 100, ttft=None), 0.1)
    plan = s.schedule(0.1)
    assert plan is not None and len(plan.prefills) == 4 and s.awd.reasons == {"tokens": 1}


def test_long_prefills_run_in_chunks_between_short_batches():
    s = sched(awd=False, long_chunk=512, max_short_streak=2)
    s.add_request(req(0, 0.0, 2000), 0.0)
    plans = drain(s)
    assert [p.num_prefill_tokens for p in plans] == [512, 512, 512, 464]
    s = sched(awd=False, long_chunk=512, max_short_streak=1)
    s.add_request(req(0, 0.0, 2000), 0.0)
    for i in range(1, 4):
        s.add_request(req(i, 0.0, 10 * i), 0.0)
    first = s.schedule(0.0)                                   # short lane first when due
    assert first.prefills[0].request.policy_state.of(LaneTag).lane == SHORT


def test_sla_guard_runs_a_squeezed_short_batch_before_the_next_long_chunk():
    """A short request still inside its AWD window goes before a long chunk when the chunk, run
    first, would leave it ≤ σ of slack; a loose one lets the chunk through (work-conserving)."""
    cost = LinearCostModel(prefill_per_token=1e-4)           # a 2048-token chunk: 0.2048 s

    def first_lane(ttft, **opts):
        s = sched(w_min=0.1, w_max=0.1, **opts)
        s.bind_cost_model(cost)
        s.add_request(req(0, 0.0, 4096, ttft=10.0), 0.0)
        s.add_request(req(1, 0.0, 64, ttft=ttft), 0.0)
        assert s._short_due(0.0)[0] is False                 # AWD alone would keep waiting
        return s.schedule(0.0).prefills[0].request.policy_state.of(LaneTag).lane, s

    lane, s = first_lane(0.25)                               # 0.25 − (0.2048 + Ŝ 0.02) ≤ σ 0.05
    assert lane == SHORT and s.guard_dispatches == 1 and s.awd.reasons == {"sla_guard": 1}
    assert first_lane(0.25, sla_guard=False)[0] == LONG
    assert first_lane(1.0)[0] == LONG
    # without a cost model the guard predicts a chunk by the last long step it observed
    s = sched(w_min=0.1, w_max=0.1)
    s.add_request(req(0, 0.0, 4096, ttft=10.0), 0.0)
    plan = s.schedule(0.0)
    assert plan.prefills[0].request.policy_state.of(LaneTag).lane == LONG
    s.update(plan, StepResult(duration=0.2), 0.2)
    s.add_request(req(1, 0.2, 64, ttft=0.25), 0.2)
    assert s.schedule(0.2).prefills[0].request.policy_state.of(LaneTag).lane == SHORT


def test_preempt_parks_the_long_chunk_and_resumes_the_same_plan():
    cost = LinearCostModel(prefill_per_token=1e-4)           # a 2048-token chunk: 0.2048 s
    s = sched(preempt="operator", w_min=0.1, w_max=0.1)
    s.bind_cost_model(cost)
    s.add_request(req(0, 0.0, 4096, ttft=10.0), 0.0)
    long_plan = s.schedule(0.0)
    assert long_plan.preemptible and long_plan.preempt_granularity == "operator"
    s.add_request(req(1, 0.05, 64, ttft=1.0), 0.05)          # loose: only AWD's window closing stops it
    assert not s.should_preempt(long_plan, 0.05) and s.next_wakeup() == pytest.approx(0.15)
    assert s.should_preempt(long_plan, s.next_wakeup())
    s.add_request(req(2, 0.06, 64, ttft=0.2), 0.06)          # tight: the chunk's remaining time eats its slack
    assert s.should_preempt(long_plan, 0.06)
    s.update(long_plan, StepResult(duration=0.06, completed=False), 0.06)
    assert s.preemptions == 1 and long_plan.prefills[0].request.num_computed_tokens == 0
    short_plan = s.schedule(0.06)
    assert {c.request.request_id for c in short_plan.prefills} == {1, 2}
    s.update(short_plan, StepResult(duration=0.01), 0.07)
    assert s.schedule(0.07) is long_plan                      # resumed, not rebuilt
    s.update(long_plan, StepResult(duration=0.15), 0.22)
    assert long_plan.prefills[0].request.num_computed_tokens == 2048
    # an aborted member: the parked plan is given up for the engine to discard
    nxt = s.schedule(0.22)
    s.update(nxt, StepResult(duration=0.01, completed=False), 0.23)
    s.abort(0, 0.23)
    assert s.dropped_plans == [nxt] and s.schedule(0.23) is None
    # a chunk let through by max_short_streak is not preempted
    s = sched(preempt="operator", awd=False, max_short_streak=1)
    s.add_request(req(0, 0.0, 4096, ttft=10.0), 0.0)
    s.add_request(req(1, 0.0, 64), 0.0)
    first = s.schedule(0.0)
    s.update(first, StepResult(duration=0.01), 0.01)
    assert first.prefills[0].request.request_id == 1
    s.add_request(req(2, 0.01, 64), 0.01)
    forced = s.schedule(0.01)                                 # streak reached: the long chunk goes
    assert forced.prefills[0].request.request_id == 0 and not s.should_preempt(forced, 0.02)
    s.update(forced, StepResult(duration=0.2), 0.21)
    s.add_request(req(3, 0.21, 64), 0.21)
    assert s.schedule(0.21).prefills[0].request.policy_state.of(LaneTag).lane == SHORT
    # LAPS alone never preempts
    plain = sched()
    plain.add_request(req(0, 0.0, 4096), 0.0)
    plan = plain.schedule(0.0)
    plain.add_request(req(1, 0.0, 64, ttft=0.01), 0.0)
    assert not plan.preemptible and not plain.should_preempt(plan, 0.0)


def test_preemption_lets_a_short_request_past_a_long_chunk_in_the_simulator():
    cost = LinearCostModel(prefill_per_token=2e-4, decode_fixed=0.001)   # a 2048-token chunk: 0.41 s
    specs = [RequestSpec(0, 0.0, 8000, 1, slo=SLO(10.0, 1.0)), RequestSpec(1, 0.1, 64, 1, slo=SLO(0.3, 1.0))]

    def short_ttft(policy):
        res = Simulator(ClusterConfig(prefill_policy=policy), cost).run(specs)
        assert res.unfinished == 0 and all(r.times.first_token is not None for r in res.requests)
        r = res.requests[1]
        return r.times.first_token - r.arrival_time, res.instances[0]["preemptions"]

    waited, none = short_ttft("laps")
    fast, preempted = short_ttft("laps-preempt")
    assert waited > 0.3 and none == 0                         # behind the running chunk (till 0.41 s)
    assert fast < 0.3 and preempted >= 1


def test_controller_moves_one_instance_with_cool_down_and_min_pool():
    c = PoolController(cool_down=10.0, tau=0.5, floor=0.1, min_pool=1)
    pools = {0: SHORT, 1: SHORT, 2: LONG, 3: LONG}
    calm = {0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2}
    assert c.step(0.0, calm, pools) is None                   # balanced: nothing moves
    hot_short = {0: 2.0, 1: 2.0, 2: 0.1, 3: 0.1}
    assert c.step(1.0, hot_short, pools, {2: 5.0, 3: 1.0}) == (3, SHORT)   # least-loaded donor
    assert pools == {0: SHORT, 1: SHORT, 2: LONG, 3: SHORT}
    assert c.step(5.0, hot_short, pools) is None              # cool-down
    assert c.step(12.0, hot_short, pools) is None             # long pool at its minimum size
    hot_long = {0: 0.0, 1: 0.0, 2: 3.0, 3: 0.0}
    assert c.step(23.0, hot_long, pools) is not None and sum(p == LONG for p in pools.values()) == 2
    assert [m[0] for m in c.moves] == [1.0, 23.0]


def test_router_sends_each_lane_to_its_pool_and_controller_runs_on_arrivals():
    class Inst:
        def __init__(self, i):
            self.instance_id, self.role, self.accepting = i, "prefill", True
            self.queued_tokens = self.num_waiting = self.num_running = 0
            self.kv_usage, self.busy_time = 0.0, 0.0
            self.scheduler = sched()

    insts = [Inst(i) for i in range(4)]
    r = LapsPoolRouter(short_fraction=0.5, period=1.0)
    picks = {SHORT: set(), LONG: set()}
    for i in range(40):
        x = req(i, i * 0.1, 50 if i % 2 else 3000)
        picks[r.classify(x)].add(r.route(x, insts, x.arrival_time))
    assert picks[SHORT] == {0, 1} and picks[LONG] == {2, 3}
    assert [i.scheduler.assigned_lane for i in insts] == [SHORT, SHORT, LONG, LONG]
    assert len(r.history) >= 3


def mixed_specs(n=1200, rate=40.0, seed=0):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        new = rng.randint(1, 200) if rng.random() < 0.8 else rng.randint(256, 6000)
        prefix = rng.choice([0, rng.randint(0, 4000)])
        out.append(RequestSpec(i, t, new + prefix, rng.randint(1, 30), slo=SLO(0.4, 0.1), prefix_len=prefix))
    return out


CONFIGS = {
    "temporal": ClusterConfig(prefill_policy="laps", prefill_opts={"prefix_caching": True}),
    "temporal-edf-fitted": ClusterConfig(prefill_policy="laps-literal:order=edf,boundary=fitted"),
    "offline": ClusterConfig(prefill_policy="laps-offline", prefill_opts={"prefix_caching": True}),
    "spatial": ClusterConfig(num_prefill=4, num_decode=2, prefill_policy="laps:mode=spatial",
                             router="laps-pools:period=0.5,cool_down=1,floor=0.0,tau=0.1",
                             prefill_opts={"prefix_caching": True}),
    "tight-kv": ClusterConfig(prefill_policy="laps", prefill_kv_tokens=12_000, num_decode=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_request_finishes_exactly_once(name, seed):
    specs = mixed_specs(seed=seed)
    sim = Simulator(CONFIGS[name], COST)
    res = sim.run(specs)
    assert res.unfinished == 0
    assert sorted(r.request_id for r in res.requests) == list(range(len(specs)))
    for r in res.requests:
        assert r.finish_reason == "length" and r.num_output_tokens == r.max_output_tokens
        assert r.arrival_time <= r.times.prefill_start <= r.times.first_token <= r.times.finished
    for inst in (*sim.front, *sim.back):
        assert inst.scheduler.kv.num_free_blocks == inst.scheduler.kv.num_blocks
        assert not inst.scheduler.has_work


def test_fitted_boundary_mode_fits_from_observed_steps():
    cfg = CONFIGS["temporal-edf-fitted"]
    sim = Simulator(cfg, COST)
    sim.run(mixed_specs(seed=3))
    clf = sim.front[0].scheduler.classifier
    assert clf.fitted_mode and clf.model.fitted and len(clf.samples) >= 16


def test_spatial_controller_moves_instances_under_pressure():
    """All load is short (400 req/s x 200 tokens = 1.6 instances' worth of prefill): the controller
    must grow the short pool, down to the long pool's minimum."""
    specs = [RequestSpec(i, i * 0.0025, 200, 1, slo=SLO(0.4, 0.1)) for i in range(3000)]
    cfg = ClusterConfig(num_prefill=4, num_decode=1, prefill_policy="laps-literal:mode=spatial,awd=false",
                        router="laps-pools-literal:period=0.5,cool_down=1.0,short_fraction=0.25")
    sim = Simulator(cfg, COST)
    from laneserve.policies import registry
    routers = []
    make_orig = registry.make

    def spy(kind, spec, *a, **k):
        obj = make_orig(kind, spec, *a, **k)
        if kind == "router" and spec.startswith("laps-pools"):
            routers.append(obj)
        return obj

    registry.make = spy
    try:
        res = sim.run(specs)
    finally:
        registry.make = make_orig
    assert res.unfinished == 0
    router = routers[0]
    assert router.controller.moves and all(m[3] == SHORT for m in router.controller.moves)
    assert sum(p == SHORT for p in router.pools.values()) == 3           # min long pool = 1
    gaps = [b[0] - a[0] for a, b in zip(router.controller.moves, router.controller.moves[1:])]
    assert all(g >= 1.0 for g in gaps)                                    # cool-down respected


def test_engine_laps_padded_buckets_keep_greedy_tokens():
    """Real engine (tiny checkpoint, 1P+1D LocalCluster): LAPS lanes, AWD and padded shape
    buckets give the same greedy tokens as FCFS, i.e. as HF's generate."""
    pytest.importorskip("torch")
    from engine_support import hf_greedy, prompts, tiny_checkpoint
    from laneserve.cluster import LocalCluster
    from laneserve.core import SamplingParams
    from laneserve.engine import EngineConfig

    path = tiny_checkpoint("qwen2")
    ps = prompts([12, 50, 3, 300, 25, 9, 40, 7], seed=4)

    def run(policy):
        reqs = [Request(i, 0.0, len(p), 5, SLO(), prompt_token_ids=list(p),
                        sampling=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
                for i, p in enumerate(ps)]
        cluster = LocalCluster(path, num_prefill=1, num_decode=1, prefill_policy=policy,
                               config=EngineConfig(num_threads=1), kv_tokens=4096)
        done = cluster.run(reqs, timeout=60)
        return {r.request_id: r.output_token_ids for r in done}, cluster.prefill[0].scheduler

    laps_out, laps = run("laps:long_chunk=128,w_min=0.02,w_max=0.02")
    assert laps.padded_tokens > laps.real_short_tokens > 0 and laps.steps[LONG] >= 3
    # FCFS's engine tokens equal HF's (test_engine_serving); so must LAPS's
    assert laps_out == {i: hf_greedy("qwen2", p, 5) for i, p in enumerate(ps)}


def test_controller_never_strips_a_busy_pool_below_capacity():
    c = PoolController(cool_down=0.0, tau=0.5, floor=0.1, max_util=0.85)
    pools = {0: SHORT, 1: SHORT, 2: LONG, 3: LONG}
    hot_short = {0: 2.0, 1: 2.0, 2: 0.0, 3: 0.0}
    busy_long = {0: 0.5, 1: 0.5, 2: 0.6, 3: 0.6}              # 1.2 busy-instances on 1 left: no
    assert c.step(1.0, hot_short, pools, utilization=busy_long) is None
    assert c.step(2.0, hot_short, pools, utilization={2: 0.4, 3: 0.4}) == (2, SHORT)


def test_laps_lanes_compose_with_slack_aware_ordering():
    """LAPS lanes with FlowPrefill's S-EDF inside each lane (composable policies):
    every request finishes once, and on the multi-SLO mix the slack-aware order beats FCFS lanes."""
    from laneserve.measure.metrics import summarize
    from laneserve.costmodel import make_cost_model
    from laneserve.sim import ClusterConfig, Simulator
    from laneserve.workloads import make_workload

    cost = make_cost_model(model="llama-3.1-8b", hardware="h100")
    wl = make_workload("flowprefill_mix", n=600, model="Llama3-8B", rate=16, seed=1)
    att = {}
    for policy in ("laps", "laps:order=sedf"):
        res = Simulator(ClusterConfig(prefill_policy=policy), cost).run(wl.specs)
        assert res.unfinished == 0
        assert all(r.num_output_tokens == r.max_output_tokens for r in res.requests)
        att[policy] = summarize(res.requests)["attainment_ttft"]
    assert att["laps:order=sedf"] > att["laps"] + 0.2
    with pytest.raises(ValueError, match="lane order"):
        Simulator(ClusterConfig(prefill_policy="laps:order=bogus"), cost).run(wl.specs[:2])


# ---- do no harm: the registered `laps` and `laps-pools` versus their literal presets ------
@functools.cache
def analytic():
    """The league's cost model (graph replay saves the per-layer launch cost; a step has a fixed cost)."""
    from laneserve.costmodel import make_cost_model
    return make_cost_model("analytic", model="llama-3.1-8b", hardware="h100")


def guarded(cost=COST, **opts) -> LapsPrefill:
    s = make("prefill", "laps", KVCacheManager(40_000, 16), **opts)
    s.bind_cost_model(cost)
    return s


def test_presets_resolve_to_the_literal_behaviour():
    from laneserve.policies.prefill.laps import LITERAL
    factory, opts = resolve("prefill", "laps-literal")
    assert factory is LapsPrefill and opts == LITERAL
    lit = make("prefill", "laps-literal", KVCacheManager(4096, 16))
    assert lit.awd_on and not lit.awd.config.light_load and lit.lanes[SHORT].order.name == "fcfs"
    assert not lit.merge and not lit.paid_padding and lit.step_slo_fraction == 0.0
    default = make("prefill", "laps", KVCacheManager(4096, 16))
    assert not default.awd_on and default.merge and default.paid_padding and default.step_slo_fraction > 0
    for ablation, key in (("laps-noawd", "awd"), ("laps-nobuckets", "shape_buckets")):
        assert resolve("prefill", ablation)[1] == {**LITERAL, key: False}       # ablations of the paper's
    assert resolve("router", "laps-pools-literal")[1] == {"spill": False}
    assert make("router", "laps-pools").spill and not make("router", "laps-pools-literal").spill


def test_at_light_load_laps_does_not_delay_short_requests_versus_fcfs():
    """Sparse short prompts among a few long ones: every short request's TTFT under `laps` is at most
    FCFS's (no batching window, no padding that the cost model says costs more), while the paper's
    window holds each lonely one back."""
    rng = random.Random(7)
    specs, t = [], 0.0
    for i in range(60):
        t += rng.expovariate(4.0)
        specs.append(RequestSpec(i, t, rng.randint(2000, 6000) if i % 6 == 0 else rng.randint(20, 200), 1,
                                 slo=SLO(0.4, 0.1)))
    short_ids = {s.request_id for s in specs if s.prompt_len < 256}

    def ttfts(policy):
        res = Simulator(ClusterConfig(prefill_policy=policy), analytic()).run(specs)
        return {r.request_id: r.times.first_token - r.arrival_time for r in res.requests}

    fcfs, laps, literal = ttfts("fcfs"), ttfts("laps"), ttfts("laps-literal")
    assert all(laps[i] <= fcfs[i] + 1e-9 for i in short_ids)
    assert sum(literal[i] for i in short_ids) > sum(fcfs[i] for i in short_ids) + 0.02 * len(short_ids) / 2


def test_a_short_request_rides_the_long_step_when_its_slack_allows_and_runs_alone_otherwise():
    s = guarded()
    s.add_request(req(0, 0.0, 6000, ttft=10.0), 0.0)
    s.add_request(req(1, 0.0, 100, ttft=0.4), 0.0)
    plan = s.schedule(0.0)                     # one step: the short prompt whole, the long one chunked
    assert plan.label.endswith(":mixed") and s.merged_steps == 1
    assert {c.request.request_id: c.num_new_tokens for c in plan.prefills} == {1: 100, 0: 2048 - 100}
    tight = guarded()
    tight.add_request(req(0, 0.0, 6000, ttft=10.0), 0.0)
    tight.add_request(req(1, 0.0, 100, ttft=0.08), 0.0)     # 0.08 - 41 ms of a merged step <= sigma
    plan = tight.schedule(0.0)
    assert [c.request.request_id for c in plan.prefills] == [1] and tight.merged_steps == 0
    literal = make("prefill", "laps-literal", KVCacheManager(40_000, 16))
    literal.bind_cost_model(COST)
    literal.add_request(req(0, 0.0, 6000, ttft=10.0), 0.0)
    literal.add_request(req(1, 0.0, 100, ttft=0.4), 0.0)
    assert all(len({c.request.policy_state.of(LaneTag).lane for c in p.prefills}) == 1 for p in drain(literal))


def test_padding_only_where_the_cost_model_says_graph_replay_pays():
    lone = guarded(analytic())
    lone.add_request(req(0, 0.0, 20), 0.0)
    assert lone.schedule(0.0).padded_shape == (32, 1)        # launch cost saved > 12 padded rows
    batch = guarded(analytic())
    for i in range(8):
        batch.add_request(req(i, 0.0, 150), 0.0)
    plan = batch.schedule(0.0)
    assert plan.padded_shape is None and len(plan.prefills) == 8   # 8 x 256 rows cost more than replay saves
    literal = make("prefill", "laps-literal:awd=false", KVCacheManager(40_000, 16))
    literal.bind_cost_model(analytic())
    for i in range(8):
        literal.add_request(req(i, 0.0, 150), 0.0)
    assert literal.schedule(0.0).padded_shape == (256, 8)


def test_long_steps_grow_only_under_loose_targets_and_while_no_short_request_waits():
    def first_step(ttft, short=False):
        s = guarded(analytic())
        s.add_request(req(0, 0.0, 20_000, ttft=ttft), 0.0)
        if short:
            s.add_request(req(1, 0.0, 100, ttft=ttft), 0.0)
        return s.schedule(0.0).num_prefill_tokens

    assert first_step(10.0) == 8192             # the instance's token budget: 0.3 s <= 0.45 x 10 s
    assert first_step(0.25) == 2048             # a 4096-token step would take > 0.45 x 0.25 s
    assert first_step(10.0, short=True) == 2048
    literal = make("prefill", "laps-literal", KVCacheManager(40_000, 16))
    literal.bind_cost_model(analytic())
    literal.add_request(req(0, 0.0, 20_000, ttft=10.0), 0.0)
    assert literal.schedule(0.0).num_prefill_tokens == 2048


class _Load:
    def __init__(self, i, queued):
        self.instance_id, self.role, self.accepting = i, "prefill", True
        self.queued_tokens, self.num_waiting, self.num_running = queued, int(queued > 0), 0
        self.kv_usage, self.busy_time = 0.0, 0.0


def test_pool_router_prefers_the_pool_only_among_the_least_loaded():
    idle = [_Load(i, 0) for i in range(4)]
    r = LapsPoolRouter(short_fraction=0.5)
    assert r.route(req(0, 0.0, 3000), idle, 0.0) in (2, 3)                   # ties: the lane's pool
    busy_long_pool = [_Load(0, 0), _Load(1, 500), _Load(2, 9000), _Load(3, 7000)]
    assert LapsPoolRouter().route(req(1, 0.0, 3000), busy_long_pool, 0.0) == 0   # overflow
    assert LapsPoolRouter(spill=False).route(req(2, 0.0, 3000), busy_long_pool, 0.0) == 3   # the paper
    busy_short_pool = [_Load(0, 400), _Load(1, 300), _Load(2, 0), _Load(3, 50)]
    assert LapsPoolRouter().route(req(3, 0.0, 60), busy_short_pool, 0.0) == 2


def test_pool_router_does_not_starve_a_pool_on_a_bursty_short_long_mix():
    """80% short / 20% long prompts in bursts at 4 prefill instances: the literal router keeps the
    long prompts (most of the work) on the long pool and loses attainment; `laps-pools` spreads the
    work and keeps least-loaded's attainment."""
    rng = random.Random(5)
    specs, t = [], 0.0
    for i in range(400):
        t += rng.expovariate(90.0) * (8.0 if i % 50 == 0 else 0.5)
        long_ = rng.random() < 0.2
        specs.append(RequestSpec(i, t, rng.randint(4000, 8000) if long_ else rng.randint(32, 256), 1,
                                 slo=SLO(4.0 if long_ else 0.4, 0.1)))

    def attainment(router):
        res = Simulator(ClusterConfig(num_prefill=4, num_decode=1, prefill_policy="laps:mode=spatial",
                                      router=router), analytic()).run(specs)
        s = summarize(res.requests, duration=res.duration)
        return s["attainment_ttft"], res

    ll, _ = attainment("least-loaded")
    pools, res = attainment("laps-pools")
    literal, _ = attainment("laps-pools-literal")
    assert res.requests and {r.prefill_instance for r in res.requests} == {0, 1, 2, 3}
    assert pools >= ll - 0.01
    assert literal < pools - 0.05


def test_pool_router_places_decode_instances_as_least_loaded():
    """Given as the decode router, ``laps-pools`` keeps no pools of decode instances and tags no
    lane: it places each finished prefill where least-loaded would."""
    from dataclasses import replace as dc_replace
    from laneserve.policies.routing import LeastLoadedRouter
    specs = [RequestSpec(i, i * 0.05, 4000 if i % 5 == 0 else 300, 40) for i in range(120)]
    base = ClusterConfig(num_prefill=2, num_decode=3)
    runs = {}
    for name in ("least-loaded", "laps-pools"):
        res = Simulator(dc_replace(base, decode_router=name), LinearCostModel()).run(specs)
        runs[name] = [(r.request_id, r.decode_instance, r.times.finished) for r in res.requests]
        assert len({d for _, d, _ in runs[name]}) == 3
    assert runs["laps-pools"] == runs["least-loaded"]
    router, ll = LapsPoolRouter(), LeastLoadedRouter()
    req = Request.from_spec(RequestSpec(0, 0.0, 5000, 4))
    decoders = Simulator(base, LinearCostModel())._make_instances()[1]
    assert router.route(req, decoders, 0.0) == ll.route(req, decoders, 0.0)
    assert router.pools == {} and req.policy_state.of(LaneTag).lane is None
