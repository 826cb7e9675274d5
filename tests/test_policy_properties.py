"""Properties every registered policy must keep, on seeded random workloads in the simulator:
every request finishes exactly once with all its tokens, nothing is left queued, and every KV
block (device and host pool) is back on its free list at the end."""

import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.costmodel import make_cost_model
from laneserve.policies import available
from laneserve.sim import ClusterConfig, Simulator

# Llama-3-8B's shape with a 128K context: the workloads have prompts beyond 8K tokens
COST = make_cost_model(model="llama-3.1-8b", hardware="h100", attention="padded")


def workload(seed: int, n: int = 250) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rng.choice([4.0, 12.0]))
        long = rng.random() < 0.2
        specs.append(RequestSpec(i, t, rng.randint(2000, 12000) if long else rng.randint(1, 400),
                                 rng.randint(1, 120), slo=SLO(rng.choice([0.3, 1.0, 4.0]), rng.choice([0.03, 0.1])),
                                 prefix_len=0))
    return specs


def check(sim: Simulator, res) -> None:
    assert res.unfinished == 0
    assert len({r.request_id for r in res.requests}) == len(res.requests)
    for r in res.requests:
        assert r.finish_reason == "length", r
        assert r.num_output_tokens == r.max_output_tokens, r
        assert r.num_computed_tokens >= r.prompt_len
    for inst in (*sim.front, *sim.back):
        sched = inst.scheduler
        assert not sched.has_work and not inst.pending
        assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.kv.tables
        pool = getattr(sched, "host_pool", None)
        if pool is not None:
            assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("policy", available("prefill"))
def test_every_prefill_policy_serves_everything_once(policy):
    for seed in (1, 2):
        sim = Simulator(ClusterConfig(prefill_policy=policy, num_decode=2, prefill_kv_tokens=60_000,
                                      decode_kv_tokens=120_000), COST)
        check(sim, sim.run(workload(seed)))


@pytest.mark.parametrize("policy", available("decode"))
def test_every_decode_policy_serves_everything_once_under_memory_pressure(policy):
    for seed in (3, 4):
        sim = Simulator(ClusterConfig(decode_policy=policy, num_prefill=2, decode_kv_tokens=40_000,
                                      host_kv_tokens=400_000), COST)
        check(sim, sim.run(workload(seed)))
