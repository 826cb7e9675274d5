"""Behaviour of the cost models (laneserve.costmodel): analytic roofline, fitted predictors,
profile I/O and the registry. No wall-clock thresholds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from laneserve.costmodel import (LAYER_OPERATORS, AnalyticCostModel, CostModel, FittedCostModel,
                                 LapsPrefillModel, PolynomialTTFT, StepTimeLUT, available_hardware,
                                 available_models, load_profile, make_cost_model, save_profile,
                                 synthesize_profile)
from laneserve.costmodel.specs import MODELS, fit_link


@pytest.fixture(scope="module")
def cm() -> AnalyticCostModel:
    return make_cost_model("analytic", model="llama-3-8b", hardware="h100")


def test_protocol_and_registry(cm):
    assert isinstance(cm, CostModel)
    assert "llama-3.1-8b" in available_models() and "qwen2.5-32b" in available_models()
    assert available_hardware() == ["a100", "h100", "h200"]
    assert make_cost_model(model="LLaMA-3-8B", hardware="H100").name == cm.name
    with pytest.raises(ValueError, match="llama-3-8b"):
        make_cost_model(model="gpt-5")
    with pytest.raises(ValueError, match="h200"):
        make_cost_model(hardware="tpu")
    with pytest.raises(ValueError, match="analytic"):
        make_cost_model("magic")
    with pytest.raises(ValueError, match="profile"):
        make_cost_model("fitted")
    with pytest.raises(ValueError):
        make_cost_model(attention="sparse")


def test_specs_match_published_sizes():
    assert MODELS["llama-3-8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["llama-2-7b"].params == pytest.approx(6.74e9, rel=0.01)
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert not MODELS["opt-13b"].gated_mlp


def test_monotonic_in_tokens_and_context(cm):
    prefill = [cm.prefill_time([(n, 0)]) for n in (1, 16, 128, 512, 2048, 8192)]
    assert all(a <= b for a, b in zip(prefill, prefill[1:]))
    assert cm.prefill_time([(512, 4096)]) > cm.prefill_time([(512, 0)])
    decode_ctx = [cm.decode_step_time([c] * 16) for c in (16, 256, 4096, 32768)]
    assert all(a < b for a, b in zip(decode_ctx, decode_ctx[1:]))
    decode_batch = [cm.decode_step_time([1024] * b) for b in (1, 8, 64, 256)]
    assert all(a < b for a, b in zip(decode_batch, decode_batch[1:]))
    assert cm.prefill_time([]) == 0.0 and cm.decode_step_time([]) == 0.0


def test_padded_vs_ragged():
    ragged = make_cost_model(attention="ragged")
    padded = make_cost_model(attention="padded")
    skewed = [128] * 31 + [4096]
    # padded walks 4096 keys for all 32 requests; ragged is held by its one 4096-key walk (no
    # split-KV), so the attention differs by ~1.6x and the whole step by ~1.2x
    assert padded.decode_attention_time(skewed) > 1.5 * ragged.decode_attention_time(skewed)
    assert padded.decode_step_time(skewed) > 1.1 * ragged.decode_step_time(skewed)
    uniform = [1024] * 32
    assert padded.decode_step_time(uniform) == pytest.approx(ragged.decode_step_time(uniform))


def test_op_times_sum_to_prefill(cm):
    for batch in ([(1, 0)], [(1000, 0)], [(300, 700), (50, 0), (4096, 128)]):
        ops = cm.prefill_op_times(batch)
        assert len(ops) == cm.num_layers * len(LAYER_OPERATORS)
        assert all(t > 0 for t in ops)
        assert math.isclose(sum(ops), cm.prefill_time(batch), rel_tol=1e-9)


def test_mixed_step_between_parts(cm):
    prefill, ctx = [(512, 0)], [2048] * 32
    mixed = cm.mixed_step_time(prefill, ctx)
    assert max(cm.prefill_time(prefill), cm.decode_step_time(ctx)) < mixed
    assert mixed < cm.prefill_time(prefill) + cm.decode_step_time(ctx)
    assert cm.mixed_step_time(prefill, []) == pytest.approx(cm.prefill_time(prefill))


def test_tensor_parallel_and_hardware(cm):
    tp2 = make_cost_model(tp=2)
    assert tp2.prefill_time([(4096, 0)]) < 0.7 * cm.prefill_time([(4096, 0)])
    h200 = make_cost_model(hardware="h200")
    assert h200.decode_step_time([2048] * 64) < 0.85 * cm.decode_step_time([2048] * 64)
    assert h200.prefill_time([(4096, 0)]) == pytest.approx(cm.prefill_time([(4096, 0)]), rel=0.1)
    a100 = make_cost_model(hardware="a100")
    assert a100.prefill_time([(4096, 0)]) > 2 * cm.prefill_time([(4096, 0)])
    assert cm.kv_transfer_time(4096, "nvlink") < cm.kv_transfer_time(4096, "rdma")
    assert cm.kv_transfer_time(4096, "infiniband") == cm.kv_transfer_time(4096, "rdma")
    with pytest.raises(ValueError):
        cm.kv_transfer_time(10, "carrier-pigeon")


def test_fit_link_recovers_constants():
    link = fit_link((b, 5e-6 + b / 300e9) for b in (1e3, 1e6, 1e7, 1e8))
    assert link.bandwidth == pytest.approx(300e9, rel=1e-6)
    assert link.latency == pytest.approx(5e-6, rel=1e-6)


def test_polynomial_ttft_recovers_polynomial():
    truth = [0.01, 2e-5, 3e-9]
    samples = [(n, truth[0] + truth[1] * n + truth[2] * n * n) for n in range(64, 8193, 256)]
    poly = PolynomialTTFT(degree=2).fit(samples)
    assert poly.coefficients == pytest.approx(truth, rel=1e-6)
    assert poly.predict(1000) == pytest.approx(0.01 + 0.02 + 0.003, rel=1e-9)
    assert poly.predict_batch([64, 128]).shape == (2,)
    assert PolynomialTTFT.from_dict(poly.to_dict()).coefficients == poly.coefficients


def test_polynomial_ttft_from_cost_model(cm):
    poly = PolynomialTTFT.from_cost_model(cm, token_grid=range(512, 8193, 512))
    for n in (1024, 4096):
        assert poly.predict(n) == pytest.approx(cm.prefill_time([(n, 0)]), rel=0.1)


def test_step_time_lut_running_mean_and_lookup(cm):
    lut = StepTimeLUT.from_cost_model(cm, batch_edges=(1, 2, 4, 8), length_edges=(128, 256, 512))
    assert lut.lookup(4, 256) == pytest.approx(cm.decode_step_time([256] * 4))
    mid = lut.lookup(3, 256)
    assert lut.lookup(2, 256) < mid < lut.lookup(4, 256)
    for _ in range(2000):
        lut.observe(4, 256, 0.05)
    assert lut.lookup(4, 256) == pytest.approx(0.05, rel=1e-3)
    assert lut.lookup(1000, 10**6) == lut.lookup(8, 512)   # clamped beyond the edges
    sparse = StepTimeLUT.from_samples([(8, 512, 0.02), (8, 512, 0.04)], batch_edges=(1, 8),
                                      length_edges=(128, 512))
    assert sparse.lookup(1, 128) == pytest.approx(0.03)   # nearest filled cell
    assert StepTimeLUT.from_dict(lut.to_dict()).lookup(3, 300) == pytest.approx(lut.lookup(3, 300))
    with pytest.raises(LookupError):
        StepTimeLUT().lookup(1, 1)


def _lut_reference(lut: StepTimeLUT, b: float, n: float) -> float:
    """Bilinear interpolation in log2 space straight on the numpy cells (what ``lookup`` computes
    from its float mirror), else the nearest filled cell."""
    def position(edges, v):
        if v <= edges[0] or len(edges) == 1:
            return 0, 0.0
        if v >= edges[-1]:
            return len(edges) - 2, 1.0
        i = max(k for k, e in enumerate(edges) if e <= v)
        return i, (math.log2(v) - math.log2(edges[i])) / (math.log2(edges[i + 1]) - math.log2(edges[i]))
    (bi, bw), (li, lw) = position(lut.batch_edges, b), position(lut.length_edges, n)
    total = 0.0
    for i, j, w in ((bi, li, (1 - bw) * (1 - lw)), (bi + 1, li, bw * (1 - lw)),
                    (bi, li + 1, (1 - bw) * lw), (bi + 1, li + 1, bw * lw)):
        if w and lut.interpolate:
            if np.isnan(lut.means[i, j]):
                break
            total += w * lut.means[i, j]
    else:
        if lut.interpolate:
            return float(total)
    cells = np.argwhere(~np.isnan(lut.means))
    return float(lut.means[tuple(cells[np.argmin(np.abs(cells - np.array([bi + bw, li + lw])).sum(axis=1))])])


@pytest.mark.parametrize("interpolate", [True, False])
def test_step_time_lut_lookup_matches_the_numpy_cells(cm, interpolate):
    """The float mirror behind ``lookup`` follows every ``set``/``observe``/``from_dict``: lookups
    equal (bit for bit) the interpolation computed on ``means`` itself, dense and sparse tables."""
    import random
    rng = random.Random(7)
    dense = StepTimeLUT.from_cost_model(cm, batch_edges=(1, 2, 3, 6, 16), length_edges=(16, 100, 1000, 5000))
    sparse = StepTimeLUT(batch_edges=(1, 4, 32), length_edges=(64, 512, 4096, 32768))
    for lut in (dense, sparse):
        lut.interpolate = interpolate
        for k in range(400):
            if k % 20 == 0:
                lut.observe(rng.randint(1, 40), rng.randint(1, 40000), rng.random() * 0.1)
            if k == 200:
                lut.set(2, 700, 0.0125)
                lut = StepTimeLUT.from_dict(lut.to_dict())
            b, n = rng.choice((rng.randint(1, 40), rng.random() * 40)), rng.random() * 40000
            assert lut.lookup(b, n) == _lut_reference(lut, b, n)


def test_laps_fit_recovers_parameters_and_boundary():
    truth = LapsPrefillModel(alpha=2e-9, beta=1e-5, gamma_w=4e-5, gamma_r=3e-6, fitted=True)
    samples = [(n, h, truth.predict(n, h)) for n in (8, 32, 128, 512, 2048, 8192, 16384, 32768)
               for h in (0, 512, 4096, 16384)]
    fit = LapsPrefillModel().fit(samples, intercept=False)
    for name in ("alpha", "beta", "gamma_w", "gamma_r"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-3)
    assert fit.boundary() == pytest.approx((4e-5 - 1e-5) / 2e-9, rel=1e-3)
    for h in (0, 1000, 8000):
        lm = fit.boundary(h)
        assert fit.t_comp(lm, h) == pytest.approx(fit.t_mem(lm, h), rel=1e-6)
    assert fit.classify(100) == "short" and fit.classify(50000) == "long"
    assert fit.boundary(10**9) == pytest.approx(truth.gamma_r / (2 * truth.alpha), rel=1e-2)
    with_intercept = LapsPrefillModel().fit(samples)
    assert with_intercept.gamma_0 == pytest.approx(0.0, abs=1e-6)
    assert LapsPrefillModel().classify(100) == "short"   # default boundary 256 before a fit
    assert LapsPrefillModel.from_dict(fit.to_dict()) == fit


def test_fitted_cost_model_round_trip(cm, tmp_path):
    rng = np.random.default_rng(0)
    prefill = [[(int(n), int(c))] for n, c in zip(rng.integers(512, 8192, 20), rng.integers(0, 8192, 20))]
    prefill += [[(1024, 0), (2048, 512)], [(4096, 0), (512, 0), (512, 1024)]]
    decode = [list(rng.integers(256, 8192, int(b))) for b in rng.integers(8, 128, 20)]
    profile = synthesize_profile(cm, prefill, decode, kv_copy_tokens=(256, 4096, 32768))
    path = save_profile(profile, tmp_path / "engine.json")
    loaded = load_profile(path)
    assert loaded == profile
    fitted = make_cost_model("fitted", profile=str(path))
    assert isinstance(fitted, FittedCostModel) and isinstance(fitted, CostModel)
    for s in profile.prefill:
        batch = list(zip(s.new_tokens, s.cached_tokens))
        assert fitted.prefill_time(batch) == pytest.approx(s.seconds, rel=0.05)
        ops = fitted.prefill_op_times(batch)
        assert len(ops) == cm.num_layers * len(LAYER_OPERATORS)
        assert sum(ops) == pytest.approx(s.seconds, rel=0.05)
    # the analytic decode time steps with FlashAttention's waves (ceil(blocks / SMs); packed GQA:
    # 8 blocks a request, a wave every 16.5 requests) and with the longest request's walk, which the
    # fitted model's regression on (batch, KV tokens) rounds off: worst sample 9.0% (batch 63, just
    # short of a 4th wave), mean 3.8%
    errors = [abs(fitted.decode_step_time(d.context_lens) / d.seconds - 1) for d in profile.decode]
    assert max(errors) < 0.10 and sum(errors) / len(errors) < 0.05
    assert fitted.kv_transfer_time(8192, "host") == pytest.approx(cm.kv_transfer_time(8192, "host"), rel=1e-6)
    assert fitted.mixed_step_time([(1024, 0)], [512] * 16) >= fitted.decode_step_time([512] * 16)
    assert fitted.kv_bytes_per_token == cm.kv_bytes_per_token and fitted.attention == "ragged"


def test_costmodel_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, laneserve.costmodel as c; c.make_cost_model(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_step_table_fill_unobserved_reaches_lookup():
    """Cells never observed take the other table's values, observed ones keep theirs, and
    ``lookup`` (which reads a float mirror of the cells) sees both."""
    from laneserve.costmodel.fitted import StepTimeLUT
    edges = dict(batch_edges=(1, 2, 4), length_edges=(16, 32, 64), interpolate=False)
    lut, prior = StepTimeLUT(**edges), StepTimeLUT(**edges)
    for b in (1, 2, 4):
        for n in (16, 32, 64):
            prior.set(b, n, 0.001 * b + 0.0001 * n)
    lut.observe(2, 32, 0.5)
    lut.fill_unobserved(prior)
    assert lut.lookup(2, 32) == 0.5
    assert lut.lookup(4, 64) == pytest.approx(0.004 + 0.0064)
    assert lut.lookup(1, 16) == pytest.approx(0.001 + 0.0016)
    with pytest.raises(ValueError):
        lut.fill_unobserved(StepTimeLUT(batch_edges=(1, 2), length_edges=(16, 32)))
