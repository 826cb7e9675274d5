"""Fit the efficiency terms of :class:`~laneserve.costmodel.specs.HardwareSpec` to the measured H100
profiles (DESIGN.md, "Cost models": analytic, calibrated on ``shared/data/profiles``).

Three stages, each minimising the mean absolute percentage error (MAPE) with Nelder-Mead in log
space:

1. GEMMs (``gemm_efficiency_max``, ``gemm_half_tokens``, ``memory_efficiency``,
   ``gemm_overhead_s``): Vidur's Llama-2-7B linear operators (tp=1, 1-4096 tokens) and
   LLMServingSim's Llama-3.1-8B q/k/v/o/gate/up/down GEMMs (1-2048 tokens), each shape on its own.
2. Prefill attention (``attention_efficiency``): LLMServingSim's ``attn`` rows, >= 256 tokens.
3. The rest of a layer (``elementwise_bytes_per_element``, ``layer_overhead_s``): LLMServingSim
   whole-model prefill totals (LM head on the last token only).

``python -m laneserve.costmodel.calibrate [--profiles DIR]`` prints the constants to record in
:data:`~laneserve.costmodel.specs.H100_CALIBRATION` and the links to record beside them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from .analytic import AnalyticCostModel
from .profile import (LLMSS_LINEAR, llmss_prefill_seconds, load_llmservingsim_layers,
                      load_vidur_mlp)
from .specs import H100_SXM, MODELS, HardwareSpec, fit_send_recv

VIDUR_FILE = "vidur_h100_llama2_7b_mlp.csv"
LLMSS_FILE = "llmservingsim_h100_llama31_8b_tp1_layers.csv"
SEND_RECV_FILE = "vidur_h100_dgx_send_recv.csv"
#: vidur operator -> our operator
VIDUR_LINEAR = {"attn_pre_proj": "qkv_proj", "attn_post_proj": "o_proj",
                "mlp_up_proj": "gate_up", "mlp_down_proj": "down"}


def default_profiles_dir() -> Path:
    """``<repo>/../shared/data/profiles``, else the copies packaged in ``laneserve/workloads/data``."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2].parent / "shared/data/profiles", here.parents[1] / "workloads/data"):
        if (candidate / VIDUR_FILE).exists():
            return candidate
    raise FileNotFoundError("H100 profiles not found; pass --profiles DIR (shared/data/profiles)")


def mape(measured: Sequence[float], predicted: Sequence[float]) -> float:
    m, p = np.asarray(measured, float), np.asarray(predicted, float)
    return float(np.mean(np.abs(p - m) / m))


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.3,
                iters: int = 300, tol: float = 1e-7) -> np.ndarray:
    """Plain Nelder-Mead minimiser (reflection, expansion, contraction, shrink)."""
    n = len(x0)
    simplex = [np.asarray(x0, float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def _fit(hw: HardwareSpec, names: Sequence[str], loss: Callable[[HardwareSpec], float]) -> HardwareSpec:
    x0 = np.log([getattr(hw, n) for n in names])
    best = nelder_mead(lambda x: loss(replace(hw, **dict(zip(names, np.exp(x))))), x0)
    return replace(hw, **{n: float(v) for n, v in zip(names, np.exp(best))})


def _llmss_kv0(profiles: Path) -> dict[int, dict[str, float]]:
    table = load_llmservingsim_layers(profiles / LLMSS_FILE)
    return {n: ops for (n, kv, tp), ops in sorted(table.items()) if kv == 0 and tp == 1}


def calibrate(profiles: Path | None = None, hw: HardwareSpec = H100_SXM) -> HardwareSpec:
    profiles = Path(profiles) if profiles else default_profiles_dir()
    vidur = [r for r in load_vidur_mlp(profiles / VIDUR_FILE) if r.tp == 1]
    llmss = _llmss_kv0(profiles)
    l2, l31 = MODELS["llama-2-7b"], MODELS["llama-3.1-8b"]
    h, kv, inter = l31.hidden_size, l31.kv_dim, l31.intermediate_size
    llmss_shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                    "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    assert set(llmss_shapes) == set(LLMSS_LINEAR)
    llmss_rows = list(llmss.items())[::4]

    def gemm_loss(cand: HardwareSpec) -> float:
        cm2 = AnalyticCostModel(l2, cand)
        meas, pred = [], []
        for r in vidur:
            ops = cm2.linear_op_times(r.num_tokens)
            for vop, op in VIDUR_LINEAR.items():
                meas.append(r.op_seconds[vop]), pred.append(ops[op])
        cm31 = AnalyticCostModel(l31, cand)
        meas2, pred2 = [], []
        for n, ops in llmss_rows:
            for op, (di, do) in llmss_shapes.items():
                meas2.append(ops[op]), pred2.append(cm31.gemm_time(n, di, do))
        return mape(meas, pred) + mape(meas2, pred2)

    hw = _fit(hw, ("gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency", "gemm_overhead_s"),
              gemm_loss)

    long_rows = [(n, ops["attn"]) for n, ops in llmss.items() if n >= 256]
    hw = _fit(hw, ("attention_efficiency",), lambda c: mape(
        [t for _, t in long_rows],
        [AnalyticCostModel(l31, c).prefill_attention_time([(n, 0)]) for n, _ in long_rows]))

    lm_last = llmss[1]["lm_head"]
    totals = [(n, llmss_prefill_seconds(ops, l31.num_layers, lm_head_seconds=lm_last))
              for n, ops in llmss_rows]
    hw = _fit(hw, ("elementwise_bytes_per_element", "layer_overhead_s"), lambda c: mape(
        [t for _, t in totals], [AnalyticCostModel(l31, c).prefill_time([(n, 0)]) for n, _ in totals]))
    return hw


CALIBRATED_FIELDS = ("gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency",
                     "attention_efficiency", "elementwise_bytes_per_element", "gemm_overhead_s",
                     "layer_overhead_s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", type=Path, default=None)
    args = parser.parse_args(argv)
    profiles = args.profiles or default_profiles_dir()
    hw = calibrate(profiles)
    print("H100_CALIBRATION = {")
    for name in CALIBRATED_FIELDS:
        print(f"    {name!r}: {getattr(hw, name):.4g},")
    print("}")
    for name, link in fit_send_recv(str(profiles / SEND_RECV_FILE)).items():
        print(f"{name}: bandwidth={link.bandwidth:.4g} B/s latency={link.latency:.3g} s")


if __name__ == "__main__":
    main()
