"""Simulator hygiene: one SLO rule for trace files, requests beyond the model's
context rejected and counted, a default host pool for AlignedServe."""

import json

import pytest

from laneserve.measure.metrics import summarize
from laneserve.cli import main
from laneserve.core import SLO
from laneserve.core.request import RequestSpec
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig, Simulator
from laneserve.sim.config import HOST_BYTES_PER_GPU, default_host_kv_tokens
from laneserve.workloads import IdleLatencySLO, Workload, load_trace

COST = make_cost_model("analytic", model="llama-3-8b", hardware="h100")   # 8,192-token context

AZURE_ROWS = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.0000000,100,20
2023-11-16 18:15:46.5000000,7000,30
2023-11-16 18:15:47.0000000,9000,10
2023-11-16 18:15:47.2000000,500,8
"""


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "tiny.csv"
    path.write_text(AZURE_ROWS)
    return path


def test_trace_slo_rule_scales_with_the_requests_idle_latency(trace):
    wl = IdleLatencySLO().apply(load_trace(trace), COST)
    short, long_ = wl.specs[0].slo, wl.specs[1].slo
    assert short == SLO(0.4, 0.05)                              # the floors
    assert long_.ttft == pytest.approx(4 * COST.prefill_time([(7000, 0)]))
    assert long_.ttft > 0.4
    assert "4 x the request's idle prefill time" in wl.meta["slo_rule"]
    fixed = IdleLatencySLO().apply(load_trace(trace), COST, ttft=2.0)
    assert {s.slo.ttft for s in fixed.specs} == {2.0}
    assert fixed.specs[0].slo.tpot == 0.05
    assert "TTFT 2 s" in fixed.meta["slo_rule"]


def test_trace_rule_does_not_depend_on_the_file_format(tmp_path):
    jsonl = tmp_path / "tiny.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 7000, "output_length": 30, "hash_ids": [1]}\n')
    csv = tmp_path / "tiny.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,7000,30\n")
    rule = IdleLatencySLO()
    assert rule.apply(load_trace(jsonl), COST).specs[0].slo == rule.apply(load_trace(csv), COST).specs[0].slo


def test_sim_cli_prints_and_records_the_trace_rule(trace, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["sim", "--trace", str(trace), "--request-rate", "1", "--policies", "fcfs+continuous",
                 "--output", str(out), "--no-progress", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "SLO rule (--trace): TTFT = max(0.4 s, 4 x" in printed
    data = json.loads((out / "sim.json").read_text())
    assert data["metrics"]["slo_rule"].startswith("TTFT = max(0.4 s")
    assert data["metrics"]["predictor"] == "online"
    assert data["rows"][0]["rejected"] == 1                      # 9,000 + 10 tokens > 8,192


def _specs(lengths):
    return [RequestSpec(i, 0.1 * i, n, 16, SLO(10.0, 1.0)) for i, n in enumerate(lengths)]


def test_requests_beyond_the_context_are_rejected_and_counted():
    specs = _specs([100, 8180, 8176, 20000, 300])            # 8180 + 16 and 20000 + 16 exceed 8192
    result = Simulator(ClusterConfig(), COST).run(specs)
    reasons = [r.finish_reason for r in result.requests]
    assert reasons == ["length", "rejected", "length", "rejected", "length"]
    assert all(r.prefill_instance is None for r in result.requests if r.finish_reason == "rejected")
    summary = summarize(result.requests, duration=result.duration)
    assert summary["rejected"] == 2 and summary["completed"] == 3 and summary["aborted"] == 0
    assert summary["attainment_both"] == pytest.approx(3 / 5)   # a refused request is a miss
    lenient = Simulator(ClusterConfig(max_model_len=0), COST).run(specs)
    assert [r.finish_reason for r in lenient.requests] == ["length"] * 5
    tight = Simulator(ClusterConfig(max_model_len=400), COST).run(specs)
    assert [r.finish_reason for r in tight.requests].count("rejected") == 3
    long_ctx = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100")
    assert all(r.finish_reason == "length" for r in Simulator(ClusterConfig(), long_ctx).run(specs).requests)


def test_alignedserve_gets_a_default_host_pool():
    sim = Simulator(ClusterConfig(decode_policy="alignedserve"), COST)
    _, back = sim._make_instances()
    pool = back[0].scheduler.host_pool
    assert pool is not None
    expected = HOST_BYTES_PER_GPU / COST.kv_bytes_per_token
    assert pool.num_blocks * pool.block_size == pytest.approx(expected, abs=16)
    assert default_host_kv_tokens(COST) == int(expected)
    _, plain = Simulator(ClusterConfig(decode_policy="continuous"), COST)._make_instances()
    assert plain[0].scheduler.host_pool is None                 # continuous batching: unchanged
    wl = Workload.from_specs("w", _specs([200, 400, 800, 1600]))
    result = Simulator(ClusterConfig(decode_policy="alignedserve"), COST).run(wl.specs)
    assert all(r.finish_reason == "length" for r in result.requests)
