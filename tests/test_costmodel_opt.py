"""The OPT sizes AlignedServe evaluates (OPT-13B, OPT-30B) in the cost model, and the planner and
simulator accepting them by name like any other model spec."""

import json

import pytest

from laneserve.cli import main
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.specs import MODELS


def test_opt_specs_match_published_sizes():
    # published: 12.85B and 29.97B weights (these counts leave out biases, norms and positions)
    for name, billions, layers, hidden in (("opt-13b", 12.85, 40, 5120), ("opt-30b", 29.97, 48, 7168)):
        m = MODELS[name]
        assert m.params == pytest.approx(billions * 1e9, rel=0.005)
        assert m.kv_bytes_per_token == 2 * layers * hidden * 2            # MHA: K and V of every head, fp16
        assert not m.gated_mlp and not m.rope and m.tied_embeddings and m.max_context == 2048


def test_opt_30b_costs_more_than_13b_per_step():
    small, big = make_cost_model(model="opt-13b"), make_cost_model(model="opt-30b")
    assert 1.8 < big.prefill_time([(1024, 0)]) / small.prefill_time([(1024, 0)]) < 3.0


def test_plan_accepts_opt_30b(tmp_path):
    rc = main(["plan", "--model", "opt-30b", "--num-requests", "20", "--request-rate", "1", "--gpus", "h100",
               "--tp", "2", "--presets", "colocated", "--max-batch", "64", "--max-sims", "2", "--jobs", "1",
               "--no-progress", "--no-curve", "--output", str(tmp_path), "--name", "opt"])
    assert rc == 0
    data = json.loads((tmp_path / "opt.json").read_text())
    assert data["spec"]["model"] == "opt-30b" and data["winner"]["meets"]


def test_sim_accepts_opt_13b(tmp_path):
    rc = main(["sim", "--model", "opt-13b", "--num-requests", "30", "--request-rate", "2", "--no-progress",
               "--jobs", "1", "--policies", "fcfs+continuous", "--output", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "sim.json").read_text())
    assert len(data["rows"]) == 1 and "AnalyticCostModel('opt-13b'" in data["title"]
