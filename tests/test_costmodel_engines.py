"""Engine cost models (vLLM / SGLang / TRT-LLM kernels) beside the unchanged legacy analytic model."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from laneserve.costmodel import AnalyticCostModel, EngineCostModel, make_cost_model
from laneserve.costmodel.engine_fit import step_mape
from laneserve.costmodel.engines import load_fits
from laneserve.costmodel.specs import HARDWARE, MODELS


def _engine(model="llama-3.1-70b", hw="h200", tp=8, engine="vllm", **kw) -> EngineCostModel:
    return EngineCostModel(MODELS[model], HARDWARE[hw], tp=tp, engine=engine, **kw)


def test_default_is_the_legacy_model_unchanged():
    default = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
    legacy = make_cost_model("analytic", model="llama-3-8b", hardware="h100", engine="legacy")
    plain = AnalyticCostModel(MODELS["llama-3-8b"], HARDWARE["h100"])
    assert type(default) is AnalyticCostModel and type(legacy) is AnalyticCostModel
    for cm in (default, legacy):
        assert cm.prefill_time([(1000, 0)]) == plain.prefill_time([(1000, 0)])
        assert cm.decode_step_time([1000, 2000]) == plain.decode_step_time([1000, 2000])
    assert isinstance(make_cost_model("analytic", model="llama-3-8b", engine="vllm"), EngineCostModel)
    with pytest.raises(ValueError):
        make_cost_model("analytic", engine="nope")


def test_split_kv_lowers_long_context_low_batch_decode_attention():
    cm = _engine()
    c = cm.constants
    unsplit = EngineCostModel(MODELS["llama-3.1-70b"], HARDWARE["h200"], tp=8, engine="vllm",
                              constants=replace(c, decode_attn_max_splits=1))
    long_ctx = [32768]
    assert cm.decode_attention_time(long_ctx) < 0.5 * unsplit.decode_attention_time(long_ctx)
    # a full batch already fills the SMs: splitting changes (almost) nothing there
    full = [4096] * 256
    assert cm.decode_attention_time(full) == pytest.approx(unsplit.decode_attention_time(full), rel=0.05)
    # and against the legacy model (one block per KV head walking all keys)
    legacy = AnalyticCostModel(MODELS["llama-3.1-70b"], HARDWARE["h200"], tp=8)
    assert cm.decode_attention_time(long_ctx) < legacy.decode_attention_time(long_ctx) / 3


def test_custom_allreduce_beats_nccl_at_small_sizes_and_meets_it_at_large():
    for engine in ("vllm", "sglang", "trtllm"):
        cm = _engine(engine=engine)
        assert cm.allreduce_time(1) < 0.5 * cm.nccl_allreduce_time(1)        # 16 KB
        big = 16384                                                            # 256 MB
        assert cm.allreduce_time(big) == pytest.approx(cm.nccl_allreduce_time(big), rel=0.35)
    graph, eager = _engine(allreduce="graph"), _engine(allreduce="eager")
    assert graph.allreduce_time(1) < eager.allreduce_time(1)
    assert _engine(tp=1, model="llama-3.1-8b").allreduce_time(100) == 0.0


def test_fused_elementwise_and_no_launch_cost():
    cm = _engine(model="llama-3.1-8b", tp=1, hw="h100")
    legacy = AnalyticCostModel(MODELS["llama-3.1-8b"], HARDWARE["h100"])
    assert sum(cm.elementwise_times(1).values()) < sum(legacy.elementwise_times(1).values())
    assert cm.hw.layer_overhead_s == 0.0


def test_prefill_attention_efficiency_ramps_with_length():
    cm = _engine(model="llama-3.1-8b", tp=1, hw="h100")
    per_flop = [cm.prefill_attention_time([(n, 0)]) / (n * n) for n in (256, 1024, 8192)]
    assert per_flop[0] > per_flop[1] > per_flop[2]
    assert cm.prefill_attention_time([(512, 4096)]) > cm.prefill_attention_time([(512, 0)])


def test_decode_step_runs_are_the_same_floats():
    cm = _engine(model="llama-3.1-8b", tp=2, hw="h100")
    for n, total, longest, steps in ((1, 5000, 5000, 40), (8, 8000, 3000, 10), (64, 64 * 900, 1500, 30)):
        run = cm.decode_step_times(n, total, longest, steps)
        assert run == [cm.decode_summary_time(n, total + n * j, longest + j) for j in range(steps)]
    assert pickle.loads(pickle.dumps(cm)).decode_summary_time(4, 4000, 1000) == cm.decode_summary_time(4, 4000, 1000)


def test_every_engine_and_gpu_has_constants_and_a100_falls_back():
    fits = load_fits()
    for engine in ("vllm", "sglang", "trtllm"):
        for system in ("h100_sxm", "h200_sxm"):
            assert (engine, system) in fits
    a100 = EngineCostModel(MODELS["llama-3-8b"], HARDWARE["a100"], tp=2, engine="vllm")
    h100 = EngineCostModel(MODELS["llama-3-8b"], HARDWARE["h100"], tp=2, engine="vllm")
    assert a100.prefill_time([(2048, 0)]) > h100.prefill_time([(2048, 0)])


def test_vllm_groups_within_15_percent_of_aiconfigurator():
    rows = step_mape(engines=("vllm",), include_legacy=False)
    assert len(rows) == 20
    for r in rows:
        assert r["mape"] <= 0.15, r


def test_sim_command_opts_in_with_engine():
    from laneserve.cli import build_parser
    assert build_parser().parse_args(["sim"]).engine == "legacy"
    assert build_parser().parse_args(["sim", "--engine", "sglang"]).engine == "sglang"


def test_laneserve_engine_without_a_profile_is_the_legacy_model():
    cm = make_cost_model("analytic", model="llama-3-8b", hardware="h100", engine="laneserve")
    assert type(cm) is AnalyticCostModel
    assert cm.prefill_time([(512, 0)]) == AnalyticCostModel(MODELS["llama-3-8b"], HARDWARE["h100"]).prefill_time([(512, 0)])
