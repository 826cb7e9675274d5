"""The Qwen3-30B-A3B spec (total vs active weights, expert GEMM shapes), the grouped expert GEMM
charged as one launch, and ``laneserve plan --model qwen3-30b-a3b``."""

from __future__ import annotations

import json

import pytest

from laneserve.cli import main
from laneserve.costmodel import make_cost_model
from laneserve.costmodel.specs import MODELS


def test_qwen3_30b_a3b_total_and_active_weights():
    m = MODELS["qwen3-30b-a3b"]
    assert m.is_moe and (m.num_experts, m.experts_per_token, m.intermediate_size) == (128, 8, 768)
    assert m.params == pytest.approx(30.5e9, rel=0.01)                            # published 30.5B
    active = m.linear_flops_per_token / 2 + 2 * m.embedding_params
    assert active == pytest.approx(3.3e9, rel=0.02)                              # published 3.3B active
    assert m.gate_up_params == 2 * 2048 * 768 and m.down_params == 768 * 2048     # one expert's GEMMs


def test_expert_weights_read_grow_with_the_batch_until_every_expert_is_touched():
    cm = make_cost_model(model="qwen3-30b-a3b")
    t = {n: cm.linear_op_times(n)["gate_up"] for n in (1, 32, 128, 512)}
    # 1 token reads 8 of 128 experts, 128 tokens nearly all of them: about 16x the bytes
    assert 8.0 < t[128] / t[1] < 16.5
    assert t[512] / t[128] < 1.1                                                  # saturated
    # one grouped launch: a single token's 8 experts cost far less than 8 separate GEMM launches
    assert t[1] < 8 * cm.gemm_time(1, 2048, 2 * 768)


def test_tensor_parallel_splits_each_expert():
    tp1, tp2 = make_cost_model(model="qwen3-30b-a3b"), make_cost_model(model="qwen3-30b-a3b", tp=2)
    assert tp2.linear_op_times(256)["gate_up"] < 0.6 * tp1.linear_op_times(256)["gate_up"]


def test_plan_accepts_qwen3_30b_a3b(tmp_path, capsys):
    rc = main(["plan", "--model", "qwen3-30b-a3b", "--num-requests", "40", "--request-rate", "4", "--gpus", "h100",
               "--tp", "1,2", "--presets", "colocated", "--max-batch", "256", "--max-sims", "4", "--jobs", "1",
               "--no-progress", "--no-curve", "--output", str(tmp_path), "--name", "moe"])
    assert rc == 0
    assert "winner:" in capsys.readouterr().out
    data = json.loads((tmp_path / "moe.json").read_text())
    assert data["spec"]["model"] == "qwen3-30b-a3b"
    assert data["winner"]["meets"] and data["deploy"]["argv"][:2] == ["laneserve", "serve"]


def test_activation_counts_one_row_per_routed_expert():
    from dataclasses import replace

    from laneserve.costmodel.analytic import AnalyticCostModel
    from laneserve.costmodel.engines import EngineCostModel
    from laneserve.costmodel import get_hardware_spec

    moe = MODELS["qwen3-30b-a3b"]
    dense = replace(moe, name="dense-twin", num_experts=0, experts_per_token=0)
    assert (moe.mlp_rows_per_token, dense.mlp_rows_per_token) == (8, 1)
    hw = get_hardware_spec("h100")
    for build in (lambda m: AnalyticCostModel(m, hw), lambda m: EngineCostModel(m, hw, engine="vllm")):
        assert build(moe).elementwise_times(4096)["down"] > 2 * build(dense).elementwise_times(4096)["down"]
