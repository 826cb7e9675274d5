"""Runs of a stable decode batch simulated as one event (sim/macro.py) give exactly what the
step-by-step loop gives: every request's counters and timestamps, every instance's figures, on
baselines, SLO-aware and colocated policies, prefix caching, memory pressure and exact time ties."""

import pickle
import random
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.core.kv import KVCacheManager
from laneserve.core.request import Request
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.analytic import AnalyticCostModel
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies.routing import LeastLoadedRouter
from laneserve.sim import ClusterConfig, Simulator
from laneserve.sim.macro import DecodeRun

COST = make_cost_model(model="llama-3-8b", hardware="h100")
# every time a multiple of 1/64 s (prompts of 64k tokens, arrivals every n/16 s): step ends,
# hand-offs and transfer ends meet at exactly equal floats
TIED = LinearCostModel(prefill_fixed=2**-6, prefill_per_token=2**-12, decode_fixed=2**-6,
                       link_bandwidth=2**29, kv_bytes_per_token=2**17, num_layers=4)


def workload(seed: int, n: int = 160, *, tied: bool = False, prefixes: bool = False) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.randrange(1, 8) / 16 if tied else rng.expovariate(rng.choice([3.0, 10.0]))
        prompt = rng.randint(2000, 9000) if rng.random() < 0.15 else rng.randint(16, 900)
        if tied:
            prompt = 64 * -(-prompt // 64)
        specs.append(RequestSpec(i, t, prompt, rng.randint(1, 300),
                                 slo=SLO(rng.choice([0.3, 1.0, 4.0]), rng.choice([0.03, 0.1])),
                                 prefix_len=rng.randint(0, prompt // 2) if prefixes else 0,
                                 session_id=i % 7 if prefixes else None))
    return specs


def fingerprint(config: ClusterConfig, specs, cost, macro: bool):
    sim = Simulator(config, cost, macro_steps=macro)
    res = sim.run(specs)
    requests = [(r.request_id, r.phase, r.finish_reason, r.num_output_tokens, r.num_computed_tokens,
                 r.num_preemptions, r.prefill_instance, r.decode_instance, asdict(r.times))
                for r in res.requests]
    return requests, res.instances, res.duration, res.unfinished, res.events


BASE = ClusterConfig(num_prefill=1, num_decode=1)
B44 = ClusterConfig(num_prefill=4, num_decode=4, prefill_policy="fcfs", decode_policy="continuous")
CONFIGS = {
    "fcfs 1P+1D": BASE,
    "fcfs 4P+4D": B44,
    "cp-edf 4P+4D least-loaded": replace(B44, prefill_policy="cp-edf-2k", router="least-loaded"),
    "sedf+kairos": replace(B44, prefill_policy="sedf", decode_policy="kairos"),
    "alignedserve": replace(B44, num_decode=2, decode_policy="alignedserve", host_kv_tokens=200_000),
    "colocated": ClusterConfig(mode="colocated", num_colocated=2),
    "laps-pools": replace(B44, prefill_policy="laps", router="laps-pools"),
    "swap pressure": replace(B44, num_decode=2, decode_kv_tokens=9_000, host_kv_tokens=60_000),
    "recompute pressure": replace(B44, num_decode=2, decode_kv_tokens=9_000,
                                  decode_opts={"preemption": "recompute"}),
    "token times": replace(BASE, num_decode=2, record_token_times=True),
    # the tpot-aware decode router reads every decode instance's contexts and last step mid-run
    "adaptive (tpot-aware decode router)": replace(B44, prefill_policy="adaptive", decode_policy="adaptive"),
    "fcfs, tpot-aware decode router, oracle": replace(B44, decode_router="tpot-aware", predictor="oracle"),
    # adaptive decode's intake takes the newest offer once the backlog is long (seed 2 makes it switch)
    "adaptive, decode memory binds": replace(B44, num_decode=2, prefill_policy="adaptive", decode_policy="adaptive",
                                             decode_kv_tokens=9_000, host_kv_tokens=60_000),
}
SEEDS = {"adaptive, decode memory binds": (2,)}


@pytest.mark.parametrize("name", CONFIGS)
def test_macro_steps_match_the_step_by_step_loop(name):
    config = CONFIGS[name]
    for seed in SEEDS.get(name, (1, 2) if config.decode_policy == "continuous" else (1,)):
        specs = workload(seed)
        step = fingerprint(config, specs, COST, macro=False)
        macro = fingerprint(config, specs, COST, macro=True)
        assert macro[:4] == step[:4]
        if config.mode != "colocated" and config.decode_policy == "continuous":
            assert macro[4] < step[4] / 2          # the runs did take over most decode steps


def test_memory_pressure_configs_do_preempt():
    for name in ("swap pressure", "recompute pressure"):
        _, instances, *_ = fingerprint(CONFIGS[name], workload(1), COST, macro=True)
        assert sum(i["preemptions"] for i in instances) > 0, name


def test_adaptive_intake_switches_in_its_config():
    sim = Simulator(CONFIGS["adaptive, decode memory binds"], COST, macro_steps=True)
    assert sim.run(workload(2)).unfinished == 0
    assert all(inst.scheduler.intake.newest_first > 0 for inst in sim.back)


def test_prefix_caching_matches():
    config = replace(B44, prefill_opts={"prefix_caching": True}, prefix_cache_tokens=0, router="cache-aware")
    specs = workload(3, prefixes=True)
    assert fingerprint(config, specs, COST, True)[:4] == fingerprint(config, specs, COST, False)[:4]


@pytest.mark.parametrize("config", [BASE, replace(B44, num_prefill=2, num_decode=2, decode_kv_tokens=6_000)])
def test_exact_time_ties_resolve_alike(config):
    """Dyadic cost and arrivals: step ends, hand-offs and transfers meet at equal times; a run
    caught up at such a time must see the steps the loop has ended by then."""
    ties = 0
    for seed in (4, 7):            # two samples: how many ties one gives depends on the policies' schedule
        specs = workload(seed, tied=True)
        step = fingerprint(config, specs, TIED, macro=False)
        macro = fingerprint(config, specs, TIED, macro=True)
        assert macro[:4] == step[:4]
        decode_starts = {r[8]["decode_start"] for r in step[0]}
        transfer_ends = {r[8]["transfer_end"] for r in step[0]}
        ties += len(decode_starts & transfer_ends)
    assert ties > 10                # transfers did land exactly at step ends


def test_macro_runs_are_deterministic():
    config = CONFIGS["swap pressure"]
    specs = workload(5)
    assert fingerprint(config, specs, COST, True) == fingerprint(config, specs, COST, True)


def test_routers_read_the_same_figures_mid_run(monkeypatch):
    """The decode router reads every decode instance while their runs are in flight: the figures
    it sees (memory, queued tokens, counts, block tables down to the block ids) are those of the
    step-by-step loop."""
    seen: list[list] = []
    route = LeastLoadedRouter.route

    def recording(self, req, instances, now):
        if instances[0].role == "decode":
            seen[-1].append([(i.kv_usage, i.queued_tokens, i.num_running, i.num_waiting,
                              sorted((rid, tuple(t)) for rid, t in i.scheduler.kv.tables.items()))
                             for i in instances])
        return route(self, req, instances, now)

    monkeypatch.setattr(LeastLoadedRouter, "route", recording)
    config = replace(B44, num_prefill=2, num_decode=3, decode_kv_tokens=20_000)
    for macro in (False, True):
        seen.append([])
        Simulator(config, COST, macro_steps=macro).run(workload(6))
    assert len(seen[0]) > 100 and seen[0] == seen[1]


@pytest.mark.parametrize("cost", [
    COST,
    make_cost_model(model="llama-3-8b", hardware="h100", attention="padded"),
    make_cost_model(model="llama-3-70b", hardware="h100", tp=4),
    AnalyticCostModel(COST.model, COST.hw, decode_kernel="per_query_head"),
])
def test_decode_step_times_are_the_decode_step_time_floats(cost):
    rng = random.Random(7)
    for batch in (1, 3, 16, 17, 40, 300):
        for top in (200, 3000, 20_000):
            # contexts on and next to key-tile boundaries too: the kernel's steps change there
            contexts = [rng.choice([rng.randint(1, top), 64 * rng.randint(1, top // 64) - rng.randint(0, 1)])
                        for _ in range(batch)]
            for steps in (5, 60, 200):   # one tile or several, kernel- or roofline-bound stretches
                want = [cost.decode_step_time([c + j for c in contexts]) for j in range(steps)]
                assert cost.decode_step_times(batch, sum(contexts), max(contexts), steps) == want


def test_append_blocks_gives_what_one_block_allocations_give():
    a, b = KVCacheManager(64, 4), KVCacheManager(64, 4)
    for kv in (a, b):
        for rid, tokens in ((1, 9), (2, 3), (3, 20)):
            kv.allocate(rid, tokens)
    order = [2, 1, 2, 3, 1]
    a.append_blocks(order)
    for rid in order:
        b.allocate(rid, (b.num_allocated(rid) + 1) * 4)
    assert a.tables == b.tables and a.num_free_blocks == b.num_free_blocks


def test_a_used_cost_model_still_pickles_for_sweep_workers():
    cost = make_cost_model(model="llama-3-8b", hardware="h100")
    want = cost.decode_step_times(4, 4000, 1500, 30)           # memoises a closure
    assert pickle.loads(pickle.dumps(cost)).decode_step_times(4, 4000, 1500, 30) == want


def test_a_runs_block_growth_is_each_requests_every_block_size_steps_in_batch_order():
    """The growth a run lists and counts for any span of steps is what walking the steps one by one
    gives: request i allocates at firsts[i], firsts[i] + bs, ...; some tables hold spare blocks,
    so their first allocation comes after a whole block's worth of steps."""
    rng, late = random.Random(7), 0
    for _ in range(20):
        kv = KVCacheManager(100_000, 16)
        batch = [Request.from_spec(RequestSpec(i, 0.0, rng.randint(1, 500), 400))
                 for i in range(rng.randint(1, 12))]
        for r in batch:
            kv.allocate(r.request_id, r.context_len + rng.choice([0, 0, 1, 40, 100]))
        run = DecodeRun.start(SimpleNamespace(scheduler=SimpleNamespace(kv=kv)), SimpleNamespace(decodes=batch),
                              0.0, COST)
        for _ in range(30):
            a = rng.randint(2, 80)
            b = rng.randint(a - 1, 300)
            walk = [r.request_id for s in range(a, b + 1) for r, f in zip(batch, run.firsts)
                    if s >= f and (s - f) % 16 == 0]
            assert run._allocated(a, b) == walk
            assert run._allocations(a, b) == len(walk)
        late += run.periodic > 2
    assert late          # the walk also covered requests whose first allocation comes late
