"""The ``adaptive`` prefill and decode policies and their place as the default."""

import argparse
import random

import pytest

from laneserve.measure.metrics import summarize
from laneserve.core import SLO, Request, RequestSpec
from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import StepResult
from laneserve.costmodel import PolynomialTTFT
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies import make
from laneserve.sim import ClusterConfig, Simulator

COST = LinearCostModel(prefill_fixed=0.005, prefill_per_token=6e-5, decode_fixed=0.01,
                       decode_per_context_token=1e-8, kv_capacity=400_000, attention="ragged")


def specs_of(lengths, rate, seed=0, ttft=0.4, tpot=0.05, out=(2, 40)):
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i, n in enumerate(lengths):
        t += rng.expovariate(rate)
        specs.append(RequestSpec(i, t, n, rng.randint(*out), slo=SLO(ttft, tpot)))
    return specs


def bimodal(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(3000, 6000) if rng.random() < 0.2 else rng.randint(16, 200) for _ in range(n)]


def chat(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(800, 3500) for _ in range(n)]


def attainment(specs, prefill, decode, cost=COST, **cfg):
    res = Simulator(ClusterConfig(prefill_policy=prefill, decode_policy=decode, **cfg), cost).run(specs)
    assert res.unfinished == 0
    return summarize(res.requests, duration=res.duration)["attainment_both"]


# ---- the default ------------------------------------------------------------------------------------
def test_adaptive_is_the_default_of_sim_and_serve():
    from laneserve.commands import serve, sim
    assert sim.DEFAULT_POLICIES.split(",")[0] == "adaptive+adaptive"
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "x"])
    assert (args.prefill_policy, args.decode_policy) == ("adaptive", "adaptive")


# ---- prefill: lanes only when lengths are bimodal ----------------------------------------------------
@pytest.mark.parametrize("lengths,expect", [(bimodal(200), True), (chat(200), False),
                                            ([64] * 200, False)])
def test_adaptive_prefill_detects_bimodal_lengths(lengths, expect):
    pol = make("prefill", "adaptive", KVCacheManager(1 << 16))
    for i, n in enumerate(lengths):
        pol.add_request(Request(i, 0.0, n, 1, SLO(1.0, None)), 0.0)
    assert pol.bimodal is expect


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_prefill_bimodality_kept_incrementally_matches_a_rescan(seed):
    """The lane switch is kept as arrivals come (a sorted list of the window's long lengths); it
    must say what a rescan of the window says after every arrival, through phases that cross
    the thresholds both ways."""
    from statistics import median
    rng = random.Random(seed)
    window = rng.choice([16, 40, 100])
    pol = make("prefill", "adaptive", KVCacheManager(1 << 18), window=window)
    lengths, seen = [], set()
    phases = [(0.2, (1000, 5000)), (0.0, None), (0.5, (256, 900)), (0.2, (1000, 5000)), (1.0, (1000, 5000)),
              (0.03, (1000, 5000)), (0.97, (1000, 5000)), (0.3, (1000, 5000))]   # long share, long lengths
    rng.shuffle(phases)
    for share_long, long_range in phases:
        for _ in range(rng.randint(window // 2, 2 * window)):
            n = rng.randint(*long_range) if rng.random() < share_long else rng.randint(1, 255)
            lengths.append(n)
            pol.add_request(Request(len(lengths), 0.0, n, 1, SLO(1.0, None)), 0.0)
            recent = lengths[-window:]
            long = [m for m in recent if m >= 256]
            share = 1 - len(long) / len(recent)
            expect = len(recent) >= 16 and 0.05 <= share <= 0.95 and median(long) >= 4 * 256
            assert pol.bimodal is expect
            seen.add(expect)
    assert seen == {True, False}                       # the stream crossed the thresholds


def test_adaptive_prefill_never_batches_short_with_long_when_bimodal():
    pol = make("prefill", "adaptive", KVCacheManager(1 << 18), token_budget=1 << 14)
    pol.bind_cost_model(COST)
    lengths = bimodal(120, seed=2)
    for i, n in enumerate(lengths):
        pol.add_request(Request(i, 0.0, n, 1, SLO(5.0, None)), 0.0)
    assert pol.bimodal
    mixed = steps = 0
    while (plan := pol.schedule(0.0)) is not None:
        lanes = {c.request.prompt_len < 256 for c in plan.prefills}
        mixed += len(lanes) > 1
        steps += 1
        pol.update(plan, StepResult(completed=True, duration=0.01), 0.0)
    assert steps > 1 and mixed == 0


def test_adaptive_prefill_keeps_flowprefills_preemption():
    pol = make("prefill", "adaptive", KVCacheManager(1 << 16))
    pol.bind_cost_model(COST)
    pol.add_request(Request(0, 0.0, 8000, 1, SLO(10.0, None)), 0.0)
    running = pol.schedule(0.0)
    assert running.preemptible
    pol.add_request(Request(1, 0.01, 50, 1, SLO(0.05, None)), 0.01)
    assert pol.should_preempt(running, 0.01)


# ---- decode ---------------------------------------------------------------------------------------------
def test_adaptive_decode_runs_without_a_host_pool_as_slack_guided_continuous_batching():
    pol = make("decode", "adaptive", KVCacheManager(1000))
    assert not pol.can_align and not pol.kv_lands_in_host
    specs = specs_of(chat(150), rate=8.0)
    assert attainment(specs, "fcfs", "adaptive") >= attainment(specs, "fcfs", "continuous")


def test_adaptive_decode_aligns_only_when_memory_binds_on_a_padded_kernel():
    specs = specs_of(bimodal(150, seed=1), rate=80.0, tpot=0.2, out=(50, 200))
    padded = LinearCostModel(prefill_fixed=0.005, prefill_per_token=6e-5, decode_fixed=0.005,
                             decode_per_context_token=1e-7, kv_capacity=400_000, attention="padded")
    tight = dict(num_prefill=2, decode_policy="adaptive:align=true,n_min=4", decode_kv_tokens=30_000,
                 host_kv_tokens=1_000_000)
    runs = {}
    for name, cost, cfg in [("roomy", COST, dict(num_prefill=2, decode_policy="adaptive:align=true",
                                                  host_kv_tokens=1_000_000)),
                            ("tight ragged", COST, tight), ("tight padded", padded, tight)]:
        sim = Simulator(ClusterConfig(**cfg), cost)
        assert sim.run(specs).unfinished == 0
        runs[name] = sim.back[0].scheduler.stats.batches_formed
    assert runs == {"roomy": 0, "tight ragged": 0, "tight padded": runs["tight padded"]}
    assert runs["tight padded"] > 0


def test_adaptive_decode_aligning_by_default_changes_nothing_on_a_ragged_kernel():
    """Alignment is on by default; on a ragged kernel it never pays, so the default decides
    exactly as ``align=false``, with decode memory for everyone and with too little."""
    specs = specs_of(chat(150, seed=2), rate=40.0, tpot=0.2, out=(20, 120))
    for device in (None, 20_000):
        times = {}
        for policy in ("adaptive", "adaptive:align=false"):
            sim = Simulator(ClusterConfig(num_prefill=2, decode_policy=policy, decode_kv_tokens=device,
                                          host_kv_tokens=1_000_000), COST)
            res = sim.run(specs)
            times[policy] = [(r.times.first_token, r.times.last_token, r.num_preemptions) for r in res.requests]
        assert times["adaptive"] == times["adaptive:align=false"]
        assert (sum(p for _, _, p in times["adaptive"]) > 0) == (device is not None)   # memory binds
    assert make("decode", "adaptive", KVCacheManager(1000), host_pool=HostKVPool(4000)).can_align


# ---- intake of offered KV transfers when decode memory binds ------------------------------------------------
def _offer(i, first_token, prompt=600):
    req = Request(i, first_token - 0.1, prompt, 50, SLO(1.0, 0.05))
    req.num_computed_tokens, req.num_output_tokens = prompt, 1
    req.times.first_token = first_token
    return req


def _finished(i, n=11, per_token=0.01):
    req = Request(1000 + i, 0.0, 100, n, SLO(1.0, 0.05))
    req.num_output_tokens, req.finish_reason = n, "length"
    req.times.first_token = req.times.decode_start = 0.0
    req.times.finished = per_token * (n - 1)
    return req


def _taken(policy, now, history=(), times=(0.0, 1.0, 2.0)):
    """Ids the decode instance takes in at ``now`` from three offers made at ``times`` (room for two)."""
    from laneserve.runtime import Instance
    sched = make("decode", policy, KVCacheManager(80, 16))       # 1280 tokens: two 601-token contexts
    for req in history:
        sched.intake.finished(req)
    inst = Instance(0, sched)
    for i, t in enumerate(times):
        inst.offer_kv(_offer(i, t))
    return [req.request_id for req, _ in inst.admit_kv(now)]


def test_adaptive_decode_takes_the_newest_offer_once_the_oldest_is_past_its_allowance():
    short = [_finished(i) for i in range(20)]       # 11 tokens at 10 ms: allowance (11 - 1) x (50 - 10) ms = 0.4 s
    assert _taken("continuous", 3.0) == [0, 1]                            # vLLM's order
    assert _taken("adaptive", 3.0) == [0, 1]                              # nothing finished yet: oldest first
    assert _taken("adaptive", 0.3, short, times=(0.0, 0.1, 0.2)) == [0, 1]   # waited 0.3 s < 0.4 s
    assert _taken("adaptive", 3.0, short) == [2, 1]                       # the oldest waited 3 s > 0.4 s
    assert _taken("adaptive:intake=oldest", 3.0, short) == [0, 1]
    assert _taken("adaptive:max_offer_wait=2.5", 3.0, short) == [0, 2]   # the bound: waited 3 s >= 2.5 s
    long = [_finished(i, n=400) for i in range(20)]   # allowance 399 x 40 ms = 16 s: still oldest first
    assert _taken("adaptive", 3.0, long) == [0, 1]
    with pytest.raises(ValueError, match="intake"):
        make("decode", "adaptive:intake=lifo", KVCacheManager(80, 16))


def _memory_bound(policy, rate):
    specs = specs_of(chat(300, seed=5), rate=rate, seed=5, tpot=0.05, out=(10, 120))
    res = Simulator(ClusterConfig(num_prefill=2, decode_policy=policy, decode_kv_tokens=20_000), COST).run(specs)
    assert res.unfinished == 0                      # no offer starves for good
    waits = [r.times.transfer_start - r.times.prefill_end for r in res.requests]
    return summarize(res.requests, duration=res.duration)["attainment_tpot"], max(waits)


def test_adaptive_decode_intake_never_loses_to_oldest_first_when_decode_memory_binds():
    """A short backlog (12 req/s): newest first would break targets that oldest first meets, and
    adaptive keeps the oldest-first order; a long one (14 req/s): adaptive switches and gains."""
    for rate in (12.0, 14.0):
        oldest, _ = _memory_bound("adaptive:intake=oldest", rate)
        ours, longest = _memory_bound("adaptive", rate)
        newest, _ = _memory_bound("adaptive:intake=newest", rate)
        assert oldest == _memory_bound("continuous", rate)[0]
        if rate == 12.0:
            assert newest < oldest and ours == oldest
        else:
            assert newest > oldest and ours > oldest
            bounded, shorter = _memory_bound("adaptive:max_offer_wait=2", rate)
            assert shorter < longest                 # the bound cuts the longest wait


# ---- slack-sized batches --------------------------------------------------------------------------------------
def _first_step(policy, tpot, n=12):
    """Requests in the first step of a decode instance holding ``n`` waiting 101-token contexts."""
    sched = make("decode", policy, KVCacheManager(1000, 16))
    sched.bind_cost_model(COST)                     # a step: 10 ms + 10 ns per context token
    for i in range(n):
        req = Request(i, 0.0, 100, 50, SLO(1.0, tpot))
        req.num_computed_tokens, req.num_output_tokens = 100, 1
        sched.reserve(req)
        sched.add_request(req, 0.0)
    return len(sched.schedule(0.0).decodes)


def test_adaptive_decode_grows_the_batch_past_max_batch_size_only_while_tpot_allows():
    assert _first_step("continuous:max_batch_size=4", 0.05) == 4
    assert _first_step("adaptive:max_batch_size=4", 0.05) == 12              # 12 x 101 tokens: ~10 ms
    assert _first_step("adaptive:max_batch_size=4,batch_ceiling=8", 0.05) == 8
    assert _first_step("adaptive:max_batch_size=4,batch_ceiling=0", 0.05) == 4
    assert _first_step("adaptive:max_batch_size=4", 0.011) == 4              # 5 x 1.2 x ~10 ms > 11 ms


def test_slack_sized_batches_meet_tpot_where_the_fixed_cap_makes_requests_wait():
    rng = random.Random(3)
    specs = specs_of([rng.randint(50, 200) for _ in range(300)], rate=40.0, seed=3, out=(50, 150))
    tpot = {}
    for policy in ("continuous:max_batch_size=8", "adaptive:max_batch_size=8,batch_ceiling=0",
                   "adaptive:max_batch_size=8"):
        res = Simulator(ClusterConfig(decode_policy=policy), COST).run(specs)
        assert res.unfinished == 0
        tpot[policy] = summarize(res.requests, duration=res.duration)["attainment_tpot"]
    assert tpot["adaptive:max_batch_size=8,batch_ceiling=0"] == tpot["continuous:max_batch_size=8"] < 0.5
    assert tpot["adaptive:max_batch_size=8"] == 1.0


# ---- the composition -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths,rate", [(chat(300), 14.0), (bimodal(300), 20.0)],
                         ids=["chat", "bimodal"])
def test_adaptive_beats_fcfs_under_load(lengths, rate):
    specs = specs_of(lengths, rate=rate)
    fcfs = attainment(specs, "fcfs", "continuous")
    res = Simulator(ClusterConfig(prefill_policy="adaptive", decode_policy="adaptive"), COST).run(specs)
    assert res.unfinished == 0
    ours = summarize(res.requests, duration=res.duration)["attainment_both"]
    # measured 0.02 -> 0.56 (chat) and 0.08 -> 0.90 (bimodal): a clear margin, not a tie broken by noise
    assert fcfs < 0.9 and ours > fcfs + 0.3
    # the mechanism fired: S-EDF preempted running prefills at operator boundaries (FCFS never does)
    prefill = [i for i in res.instances if i["role"] == "prefill"]
    assert sum(i["preemptions"] for i in prefill) > 0


@pytest.mark.parametrize("factor", [0.8, 1.2])
def test_adaptive_holds_up_with_a_ttft_predictor_20_percent_off(factor):
    specs = specs_of(bimodal(300, seed=4), rate=20.0, seed=4)
    poly = PolynomialTTFT.from_cost_model(COST)
    skewed = attainment(specs, "adaptive", "adaptive",
                        prefill_opts={"predictor": lambda n: factor * poly.predict(n)})
    assert skewed > attainment(specs, "fcfs", "continuous")
    assert skewed >= 0.9 * attainment(specs, "adaptive", "adaptive")


# ---- the engine -------------------------------------------------------------------------------------------
def test_engine_adaptive_greedy_tokens_equal_fcfs_and_continuous_batching():
    from engine_support import prompts, tiny_checkpoint
    from laneserve.cluster import LocalCluster
    from laneserve.core import SamplingParams
    from laneserve.engine import EngineConfig

    path = tiny_checkpoint("qwen3")
    ps = prompts([12, 50, 3, 70, 25, 9], seed=5)
    outs = {}
    for prefill, decode in (("fcfs", "continuous"), ("adaptive", "adaptive")):
        reqs = [Request(i, 0.005 * i, len(p), 16, SLO(5.0, 1.0), prompt_token_ids=list(p),
                        sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
                for i, p in enumerate(ps)]
        cluster = LocalCluster(path, prefill_policy=prefill, decode_policy=decode, kv_tokens=4096,
                               config=EngineConfig(num_threads=1, num_host_blocks=128))
        done = cluster.run(reqs, timeout=60)
        outs[decode] = {r.request_id: r.output_token_ids for r in done}
        assert len(outs[decode]) == len(ps)
        # the instances really ran the policies named (not a fallback to the baselines)
        assert [i.scheduler.name for i in (*cluster.prefill, *cluster.decode)] == [prefill, decode]
    assert outs["adaptive"] == outs["continuous"]
    # when adaptive's mechanisms fire on the engine (wall-clock arrivals here decide whether they
    # do) is the next test's job, on a clock that makes them fire deterministically


def test_engine_adaptive_prefill_preempts_at_operator_boundaries_and_keeps_greedy_tokens():
    """Short prompts with tight TTFT targets land in the middle of long prefills (a clock that
    ticks on every reading makes that deterministic): adaptive prefill stops the long ones at
    operator boundaries and resumes them, and every greedy token equals FCFS's."""
    from test_prefill_flowprefill import _engine_pd_run
    fcfs, _ = _engine_pd_run("fcfs")
    ours, sched = _engine_pd_run("adaptive")
    assert sched.name == "adaptive" and sched.num_preemptions > 0 and not sched.parked
    assert ours == fcfs


def test_engine_adaptive_intake_takes_the_newest_offer_and_loses_nothing():
    """Decode memory for about two requests, TPOT targets no step can meet (every offer is past its
    allowance once a request has finished): the engine's decode instance takes offers newest
    first, every request finishes, and greedy outputs equal continuous batching's."""
    from engine_support import prompts, tiny_checkpoint
    from laneserve.cluster import LocalCluster
    from laneserve.core import SamplingParams
    from laneserve.engine import EngineConfig

    path = tiny_checkpoint("qwen3")
    ps = prompts([40, 60, 30, 70, 50, 45, 65, 35], seed=7)
    outs, newest = {}, {}
    for decode in ("continuous", "adaptive"):
        reqs = [Request(i, 0.0, len(p), 12, SLO(5.0, 1e-6), prompt_token_ids=list(p),
                        sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                for i, p in enumerate(ps)]
        cluster = LocalCluster(path, num_prefill=2, prefill_policy="fcfs", decode_policy=decode, kv_tokens=192,
                               config=EngineConfig(num_threads=1))
        done = cluster.run(reqs, timeout=120)
        outs[decode] = {r.request_id: r.output_token_ids for r in done}
        assert len(outs[decode]) == len(ps) and all(r.finish_reason == "length" for r in done)
        newest[decode] = getattr(cluster.decode[0].scheduler, "intake", None)
    assert outs["adaptive"] == outs["continuous"]
    assert newest["continuous"] is None and newest["adaptive"].newest_first > 0


def test_adaptive_holds_the_mechanisms_instead_of_deriving_from_the_reproductions():
    """Editing a reproduction's class cannot change the default: adaptive derives from the generic
    bases and the components' wiring only (defined beside the components, which the reproductions
    mix in too), never from a reproduction, and holds the same mechanism components."""
    from laneserve.policies.decode.adaptive import AdaptiveDecode
    from laneserve.policies.decode.mechanisms.aligned_guard import AlignmentGuard
    from laneserve.policies.decode.mechanisms.aligner import AlignedWiring, LengthAligner
    from laneserve.policies.decode.alignedserve import AlignedServeDecode
    from laneserve.policies.decode.base import DecodeScheduler
    from laneserve.policies.prefill.adaptive import AdaptivePrefill
    from laneserve.policies.prefill.base import PrefillScheduler
    from laneserve.policies.prefill.sedf import SEDFPrefill
    from laneserve.policies.prefill.mechanisms.sedf_ordering import SEDFOrdering
    from laneserve.policies.prefill.mechanisms.sedf_tasks import PreemptiveTasks, SEDFWiring
    from laneserve.policies.prefill.mechanisms.slo_batching import SLOAwareBatching
    assert AdaptivePrefill.__bases__ == SEDFPrefill.__bases__ == (SEDFWiring, PrefillScheduler)
    assert AdaptiveDecode.__bases__ == AlignedServeDecode.__bases__ == (AlignedWiring, DecodeScheduler)
    assert SEDFPrefill not in AdaptivePrefill.__mro__ and AlignedServeDecode not in AdaptiveDecode.__mro__
    for name in ("adaptive", "sedf"):
        pol = make("prefill", name, KVCacheManager(1000))
        assert type(pol.ordering) is SEDFOrdering and type(pol.batcher) is SLOAwareBatching
        assert type(pol.tasks) is PreemptiveTasks
    for name in ("adaptive", "alignedserve"):
        pol = make("decode", name, KVCacheManager(1000), host_pool=HostKVPool(4000))
        assert type(pol.aligner) is LengthAligner and type(pol.aligner.guard) is AlignmentGuard
    assert make("decode", "alignedserve-literal", KVCacheManager(1000), host_pool=HostKVPool(4000)).aligner.guard is None
