"""Simulator + baseline policies: conservation, determinism, memory pressure, ordering."""

import random

import pytest

from laneserve.core import SLO, RequestSpec
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.linear import LinearCostModel
from laneserve.policies import available, make, parse_spec
from laneserve.sim import ClusterConfig, Simulator

COST = LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01, decode_per_context_token=1e-7,
                       kv_capacity=200_000)


def mixed_specs(n=1500, rate=8.0, seed=0, max_prompt=3000, max_out=200):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(RequestSpec(i, t, rng.randint(1, max_prompt), rng.randint(1, max_out),
                               slo=SLO(1.0, 0.1)))
    return out


CONFIGS = {
    "1p1d-fcfs": ClusterConfig(),
    "2p2d-cp2k-ll": ClusterConfig(num_prefill=2, num_decode=2, prefill_policy="cp-edf-2k",
                                  router="least-loaded"),
    "cp8k": ClusterConfig(prefill_policy="cp-edf:chunk=8192"),
    "colocated": ClusterConfig(mode="colocated", num_colocated=2),
    "decode-swap": ClusterConfig(decode_kv_tokens=20_000, host_kv_tokens=40_000),
    "decode-recompute": ClusterConfig(decode_kv_tokens=20_000, decode_opts={"preemption": "recompute"}),
    "tight-prefill": ClusterConfig(prefill_kv_tokens=8_000, num_decode=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_request_served_exactly_once_and_kv_returned(name):
    specs = mixed_specs()
    sim = Simulator(CONFIGS[name], COST)
    res = sim.run(specs)
    assert res.unfinished == 0
    assert sorted(r.request_id for r in res.requests) == list(range(len(specs)))
    for r in res.requests:
        assert r.finish_reason == "length"
        assert r.num_output_tokens == r.max_output_tokens          # no token lost or duplicated
        t = r.times
        assert r.arrival_time <= t.prefill_start <= t.prefill_end == t.first_token <= t.finished
        if r.max_output_tokens > 1 and CONFIGS[name].mode == "disaggregated":
            assert t.prefill_end <= t.transfer_start <= t.transfer_end <= t.decode_start
    for inst in (*sim.front, *sim.back):
        kv = inst.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks and not kv.tables      # nothing leaked
        assert not inst.scheduler.has_work


def test_memory_pressure_preempts_and_still_finishes():
    for cfg in (CONFIGS["decode-swap"], CONFIGS["decode-recompute"]):
        sim = Simulator(cfg, COST)
        res = sim.run(mixed_specs(rate=20))
        assert sum(s["preemptions"] for s in res.instances) > 0
        assert res.unfinished == 0
        if sim.back[0].scheduler.host_pool is not None:
            pool = sim.back[0].scheduler.host_pool
            assert pool.num_free_blocks == pool.num_blocks


def test_deterministic():
    a = Simulator(CONFIGS["2p2d-cp2k-ll"], COST).run(mixed_specs(seed=4))
    b = Simulator(CONFIGS["2p2d-cp2k-ll"], COST).run(mixed_specs(seed=4))
    assert [(r.times.first_token, r.times.finished) for r in a.requests] == \
           [(r.times.first_token, r.times.finished) for r in b.requests]


def test_request_larger_than_memory_fails_cleanly():
    specs = [RequestSpec(0, 0.0, 50_000, 5), RequestSpec(1, 0.1, 100, 5)]
    res = Simulator(ClusterConfig(prefill_kv_tokens=10_000), COST).run(specs)
    assert res.requests[0].finish_reason == "error"
    assert res.requests[1].finish_reason == "length"


def test_cp_edf_serves_earliest_deadline_first():
    # one long request occupies the instance; then a loose and a tight request arrive
    specs = [RequestSpec(0, 0.0, 4000, 1, slo=SLO(10.0)), RequestSpec(1, 0.01, 1000, 1, slo=SLO(5.0)),
             RequestSpec(2, 0.02, 1000, 1, slo=SLO(0.5))]
    res = Simulator(ClusterConfig(prefill_policy="cp-edf:chunk=512"), COST).run(specs)
    done = {r.request_id: r.times.prefill_end for r in res.requests}
    assert done[2] < done[1] < done[0]
    fcfs = Simulator(ClusterConfig(prefill_policy="fcfs"), COST).run(specs)
    done = {r.request_id: r.times.prefill_end for r in fcfs.requests}
    assert done[0] < done[1] <= done[2]   # FCFS batches 1 and 2 together behind 0


def test_routers_spread_load():
    specs = mixed_specs(n=400, rate=30)
    for router in ("round-robin", "least-loaded"):
        res = Simulator(ClusterConfig(num_prefill=4, router=router), COST).run(specs)
        counts = [0] * 4
        for r in res.requests:
            counts[r.prefill_instance] += 1
        assert min(counts) > 50, (router, counts)


def test_head_of_line_blocking_grows_with_long_share():
    """FCFS: short requests' P90 TTFT rises with the share of long prompts (LAPS Figure 3)."""
    cost = make_cost_model(model="llama-3-8b", hardware="h100")
    p90 = []
    for long_share in (0.0, 0.1, 0.3):
        rng = random.Random(1)
        t, specs = 0.0, []
        for i in range(1500):
            t += rng.expovariate(6.0)
            long = rng.random() < long_share
            specs.append(RequestSpec(i, t, rng.randint(4096, 8192) if long else rng.randint(32, 256), 1))
        res = Simulator(ClusterConfig(), cost).run(specs)
        short = sorted(r.times.first_token - r.arrival_time for r in res.requests if r.prompt_len <= 256)
        p90.append(short[int(0.9 * len(short))])
    assert p90[0] < p90[1] < p90[2]
    assert p90[2] > 3 * p90[0]


def test_registry_specs_and_errors():
    assert parse_spec("cp-edf:chunk=2048,prefix_caching=true") == \
        ("cp-edf", {"chunk": 2048, "prefix_caching": True})
    assert {"fcfs", "cp-edf", "cp-edf-2k"} <= set(available("prefill"))
    with pytest.raises(ValueError, match="available"):
        make("prefill", "nope", None)
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("fcfs:oops")
    with pytest.raises(ValueError, match="bad options"):
        Simulator(ClusterConfig(prefill_policy="fcfs:bogus=1"), COST).run(mixed_specs(n=2))
    with pytest.raises(ValueError):
        ClusterConfig(mode="mesh")


def test_colocated_runs_laps_with_buckets_and_awd_wakeups():
    """A colocated instance forwards the prefill policy's wake-ups (AWD windows) and keeps its
    bucket shapes on pure prefill steps; every request still finishes once."""
    specs = mixed_specs(n=400, rate=20, max_prompt=200, max_out=8)
    sim = Simulator(ClusterConfig(mode="colocated", colocated_policy="colocated:prefill=laps"), COST)
    res = sim.run(specs)
    assert res.unfinished == 0
    assert all(r.num_output_tokens == r.max_output_tokens for r in res.requests)
    laps = sim.front[0].scheduler.prefill
    assert laps.padded_tokens > 0                      # bucketed steps ran
    assert sum(laps.awd.reasons.values()) > 0          # AWD dispatched batches


def test_colocated_cp_edf_keeps_its_chunk_inside_the_step_budget(monkeypatch):
    """Colocated, a CP-EDF prefill side gets the step's budget left after its decodes, but never
    more tokens than its own chunk: ``cp-edf:chunk=256`` under a 2048-token budget plans chunks of
    at most 256 tokens (and uses the whole chunk when a prompt is long enough)."""
    from laneserve.policies.prefill.cp_edf import ChunkedEDFPrefill
    planned: list[int] = []
    schedule = ChunkedEDFPrefill.schedule

    def recording(self, now, token_budget=None):
        plan = schedule(self, now, token_budget)
        if plan is not None:
            planned.append(sum(c.num_new_tokens for c in plan.prefills))
        return plan

    monkeypatch.setattr(ChunkedEDFPrefill, "schedule", recording)
    specs = mixed_specs(n=60, rate=20, max_prompt=3000, max_out=4)
    res = Simulator(ClusterConfig(mode="colocated", colocated_policy="colocated:prefill=cp-edf:chunk=256,token_budget=2048"),
                    COST).run(specs)
    assert res.unfinished == 0
    assert planned and max(planned) == 256
