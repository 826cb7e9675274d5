"""The multi-GPU terms of the analytic cost model (all-reduce, host overhead,
FlashAttention thread-block schedule, MoE, new specs) and calibration as code."""

from __future__ import annotations

import json

import pytest

from laneserve.costmodel import AnalyticCostModel, get_hardware_spec, get_model_spec, make_cost_model
from laneserve.costmodel.analytic import DECODE_KERNELS
from laneserve.costmodel.calibrate import (attention_sample_model, attention_split,
                                           constants_module, fit_allreduce_link, fit_host_overhead,
                                           load_attention_sample, mape, predict_attention_row)
from laneserve.costmodel.specs import MODELS, HostOverhead, LinkSpec


def test_new_specs_match_published_sizes():
    for name, billions in (("llama-2-70b", 69.0), ("llama-3.1-405b", 405.8), ("qwen2.5-72b", 72.7),
                           ("qwen3-32b", 32.8), ("mixtral-8x7b", 46.7)):
        assert MODELS[name].params == pytest.approx(billions * 1e9, rel=0.01)
    mix = MODELS["mixtral-8x7b"]
    assert mix.is_moe and 12e9 < mix.linear_flops_per_token / 2 < 13e9      # ~12.9B active


def test_moe_reads_more_experts_as_the_batch_grows():
    mix = make_cost_model(model="mixtral-8x7b")
    one = mix.linear_op_times(1)["gate_up"]
    # one token touches 2 of 8 experts, a large batch all 8: about 4x the weight traffic
    assert 3.0 < mix.linear_op_times(256)["gate_up"] / one < 5.0


def test_allreduce_grows_with_gpus_and_bytes_and_has_a_floor():
    h100 = get_hardware_spec("h100")
    small = [h100.allreduce_link(n).transfer_time(16 * 1024) for n in (2, 4, 8)]
    assert all(10e-6 < t < 60e-6 for t in small)                            # latency floor
    big = [h100.allreduce_link(n).transfer_time(64 * 2**20) for n in (2, 4, 8)]
    assert big[0] < big[1] < big[2]
    assert h100.allreduce_link(3) == h100.allreduce_link(4)                 # next measured count
    cm2 = make_cost_model(model="llama-2-70b", tp=2)
    assert cm2.allreduce_time(1) == pytest.approx(h100.allreduce_link(2).transfer_time(8192 * 2))
    assert make_cost_model(model="llama-2-70b").allreduce_time(100) == 0.0


def test_fit_allreduce_recovers_constants():
    truth = LinkSpec(bandwidth=250e9, latency=20e-6, floor=40e-6)
    sizes = [2048, 65536, 2**20, 2**21, 2**22, 2**23, 2**24, 2**25, 2**26]
    link = fit_allreduce_link([(b, truth.transfer_time(b)) for b in sizes])
    assert link.floor == pytest.approx(40e-6, rel=0.05)
    assert link.bandwidth == pytest.approx(250e9, rel=0.05)
    for b in sizes:
        assert link.transfer_time(b) == pytest.approx(truth.transfer_time(b), rel=0.03)
    assert LinkSpec(bandwidth=1e9, latency=1e-6, floor=5e-6).transfer_time(1000) == 5e-6
    assert LinkSpec(bandwidth=1e9, latency=1e-6, floor=5e-6).transfer_time(0) == 0.0


def test_small_kernels_have_a_floor_and_eager_extras_drop_without_launch():
    cm = make_cost_model(model="llama-2-70b", tp=4)
    hw = cm.hw
    one = cm.elementwise_times(1, eager=False)
    # five small kernels a layer (two norms, rotary, activation, residual add), each at least a floor
    assert sum(one.values()) == pytest.approx(5 * hw.kernel_floor_s, rel=0.02)
    assert sum(cm.elementwise_times(1).values()) > sum(one.values())     # unfused eager traffic
    gpu, eager = cm.layer_time(1, 0.0, launch=False), cm.layer_time(1, 0.0)
    assert eager - gpu == pytest.approx(hw.layer_overhead_s + sum(cm.elementwise_times(1).values())
                                        - sum(one.values()), rel=1e-6)


def test_host_overhead_term_and_fit():
    truth = HostOverhead(base_s=1e-3, per_seq_s=5e-5, tp_s=6e-3)
    rows = [("m", b, tp, truth.time(b, tp)) for b in (8, 32, 128) for tp in (1, 4)]
    fit = fit_host_overhead(rows)
    for name in ("base_s", "per_seq_s", "tp_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert truth.time(0, 4) == 0.0
    gpu = make_cost_model(model="llama-2-70b", hardware="a100", tp=4)
    full = make_cost_model(model="llama-2-70b", hardware="a100", tp=4, host_overhead=True)
    extra = full.decode_step_time([512] * 8) - gpu.decode_step_time([512] * 8)
    assert extra == pytest.approx(get_hardware_spec("a100").host.time(8, 4))
    assert sum(full.prefill_op_times([(100, 0)])) == pytest.approx(full.prefill_time([(100, 0)]))


def test_per_token_time_falls_slower_than_one_over_tp():
    """The issue's symptom: measured 70B per-token time barely falls from TP 4 to 8; with the
    all-reduce floor and the host cost the model no longer scales it by ~1/TP."""
    t = {tp: make_cost_model(model="llama-2-70b", hardware="a100", tp=tp, host_overhead=True)
         .decode_step_time([512]) for tp in (2, 4, 8)}
    assert t[8] / t[4] > 0.75 and t[4] / t[2] > 0.6


def test_batch1_long_context_decode_is_bound_by_one_block_walk():
    # the kernel the LLMServingSim sample measured: a block per query head (16 a request at tp 4)
    cm = AnalyticCostModel(get_model_spec("llama-3.1-70b"), get_hardware_spec("h100"), tp=4,
                           decode_kernel="per_query_head")
    one = cm.decode_attention_time([65536])
    assert one == pytest.approx(1.75e-3, rel=0.1)                           # FlashAttention measures 1.75 ms
    # the same KV split over 8 requests runs 8x the blocks side by side
    assert cm.decode_attention_time([8192] * 8) < one / 6
    # past the SM count the blocks queue in waves: 9 requests are slower than 8
    assert cm.decode_attention_time([65536 // 9] * 9) > cm.decode_attention_time([8192] * 8)


def test_padded_kernel_walks_the_longest_context_for_every_request():
    ragged = make_cost_model(model="llama-3-8b")
    padded = make_cost_model(model="llama-3-8b", attention="padded")
    skewed = [256] * 63 + [16384]
    assert padded.decode_attention_time(skewed) > 2 * ragged.decode_attention_time(skewed)
    assert padded.prefill_attention_time([(64, 0), (4096, 0)]) > ragged.prefill_attention_time([(64, 0), (4096, 0)])


def test_attention_sample_fit_and_split():
    rows = load_attention_sample()
    fit, held = attention_split(rows)
    assert len(rows) == len(fit) + len(held) and held and all(not r["prefill"] for r in held)
    cm = attention_sample_model(get_hardware_spec("h100"))
    assert mape([r["seconds"] for r in held], [predict_attention_row(cm, r) for r in held]) < 0.15


def test_graph_replay_keeps_host_and_collectives():
    cm = make_cost_model(model="llama-2-70b", tp=4, host_overhead=True)
    batch = [(64, 0)] * 4
    saved = cm.prefill_time(batch) - cm.graphed_prefill_time(batch)
    assert saved == pytest.approx(cm.num_layers * cm.hw.layer_overhead_s)


def test_constants_module_round_trips(tmp_path):
    report = {"constants": {"H100_CALIBRATION": {"gemm_efficiency_max": 0.8},
                            "H100_ATTENTION": {"attn_key_s": 2.5e-08, "attn_tile_keys": 64},
                            "ALLREDUCE": {"h100": {2: [1e-05, 3e11, 3e-05]}},
                            "HOST_OVERHEAD": {"base_s": 0.001, "per_seq_s": 5e-05, "tp_s": 0.006}}}
    namespace: dict = {}
    exec(constants_module(report), namespace)
    assert namespace["H100_ATTENTION"] == {"attn_key_s": 2.5e-08, "attn_tile_keys": 64}
    assert namespace["ALLREDUCE"]["h100"][2] == [1e-05, 3e11, 3e-05]
    json.dumps(report)


def test_calibrate_cli_reports_per_file_mape(tmp_path):
    from laneserve.cli import main
    from laneserve.costmodel.calibrate import default_profiles_dir
    default_profiles_dir()           # the packaged profiles: raises (never skips) if one is missing
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["constants"]["ALLREDUCE"]) == {"h100", "a100"}
    mapes = report["mape"]
    assert all(v < 0.15 for v in mapes["allreduce_h100 (fitted)"].values())
    assert all(v < 0.15 for v in mapes["linear_llama2_70b_a100 (held out)"].values())
    assert all(v < 0.15 for v in mapes["small_ops_llama2_70b_h100 (held out)"].values())


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("lens", [[1], [65536], [1024] * 32, [4096] * 128, [100] * 7 + [30000]])
def test_decode_attention_never_beats_its_kv_bytes(kernel, lens):
    cm = AnalyticCostModel(get_model_spec("llama-3-8b"), get_hardware_spec("h100"), decode_kernel=kernel)
    kv_bytes = sum(lens) * cm.kv_bytes_per_token / cm.num_layers
    assert cm.decode_attention_time(lens) >= kv_bytes / cm.hw.hbm_bandwidth + cm.hw.attn_floor_s


def test_packed_gqa_decode_runs_a_block_per_kv_head():
    h100, spec = get_hardware_spec("h100"), get_model_spec("llama-3-8b")     # 32 query, 8 KV heads
    packed = AnalyticCostModel(spec, h100)
    per_head = AnalyticCostModel(spec, h100, decode_kernel="per_query_head")
    big = [1024] * 128
    kv_bound = sum(big) * spec.kv_bytes_per_token / spec.num_layers / h100.hbm_bandwidth
    # saturated, the packed kernel streams the KV about once; a block per query head re-walks it 4x
    assert packed.decode_attention_time(big) < 1.3 * kv_bound
    assert per_head.decode_attention_time(big) > 3.5 * packed.decode_attention_time(big)
    # one request: the longest walk bounds both grids alike
    assert packed.decode_attention_time([4096]) == per_head.decode_attention_time([4096])
    # 8 blocks a request: a second wave starts at 17 requests (136 > 132 SMs), not at 5
    assert packed.decode_attention_time([4096] * 17) > 1.3 * packed.decode_attention_time([4096] * 16)
    assert packed.decode_attention_time([4096] * 5) == packed.decode_attention_time([4096] * 4)
