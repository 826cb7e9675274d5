"""Fit the engine cost models' constants (:mod:`laneserve.costmodel.engines`) to aiconfigurator's
per-operator measurements, and score them.

``python -m laneserve.costmodel.engine_fit`` rewrites ``data/engine_fits.json`` from
``data/aiconfigurator_steps.csv`` (written by ``benchmarks/engine_tables.py``). For each engine
(vllm, sglang, trtllm) and GPU (h100_sxm, h200_sxm), each stage minimising the mean absolute
percentage error with Nelder-Mead in log space (numpy only):

1. GEMMs (efficiency ramp, memory efficiency, per-kernel overhead): the four layer GEMMs of every
   decode and prefill row, and the LM head;
2. fused element-wise kernels: the two add+norm kernels and the SiLU-and-mul kernel (each
   ``floor + elements * bytes / bw``);
3. split-KV decode attention (floor, per-request cost, bandwidth efficiency, per-key walk), for
   each split cap in :data:`SPLIT_CAPS`, the best kept;
4. FlashAttention-3 prefill (floor, efficiency, ramp).

All-reduce is not fitted: the measured curves are read as they are. :func:`step_mape` scores
whole steps (every operator group, all layers) against the same rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .calibrate import mape, nelder_mead
from .engines import (FITS_PATH, MEASURED_ENGINES, SYSTEMS, EngineConstants, EngineCostModel,
                      decode_attention_times, gemm_times, load_reference_steps)
from .specs import HARDWARE, MODELS

SPLIT_CAPS = (8, 16, 32, 64, 128)
HW_OF = {v: k for k, v in SYSTEMS.items()}
START = dict(gemm_efficiency_max=0.8, gemm_half_tokens=150.0, memory_efficiency=0.85,
             gemm_overhead_s=4e-6, norm_floor_s=2.5e-6, norm_bytes_per_element=8.0,
             act_floor_s=2.5e-6, act_bytes_per_element=6.0, decode_attn_floor_s=1e-5,
             decode_attn_per_request_s=5e-8, decode_attn_efficiency=0.85, decode_attn_key_s=2e-8,
             decode_attn_max_splits=32, prefill_attn_floor_s=2e-5, prefill_attn_efficiency=0.7,
             prefill_attn_half_tokens=200.0)


def _rows(engine: str, system: str, rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r["backend"] == engine and r["system"] == system]


def _tokens(r: dict) -> int:
    return r["batch"] if r["phase"] == "decode" else r["batch"] * r["length"]


def _nm(loss, names: Sequence[str], c: dict[str, float], iters: int = 600) -> dict[str, float]:
    x0 = np.log([c[n] for n in names])
    best = nelder_mead(lambda x: loss(dict(zip(names, np.exp(x)))), x0, iters=iters)
    best = nelder_mead(lambda x: loss(dict(zip(names, np.exp(x)))), best, step=0.1, iters=iters)
    return dict(zip(names, np.exp(best).tolist()))


def fit_one(engine: str, system: str, rows: Sequence[dict]) -> dict[str, Any]:
    """Fitted constants (and per-stage MAPE) of ``engine`` on ``system``."""
    hw = HARDWARE[HW_OF[system]]
    data = _rows(engine, system, rows)
    c: dict[str, Any] = dict(START)
    report: dict[str, Any] = {}
    # each stage fits its constants into c (later stages see the earlier fits) and adds its MAPE
    _fit_gemms(c, report, engine, system, hw, data)
    _fit_elementwise(c, report, hw, data)
    _fit_decode_attention(c, report, engine, system, hw, data)
    _fit_prefill_attention(c, report, hw, data)
    out = {"engine": engine, "system": system, "version": data[0]["version"]}
    for k in START:
        v = c[k]
        out[k] = int(v) if k == "decode_attn_max_splits" else float(f"{v:.5g}")
    out["fit_mape"] = {k: round(v, 4) for k, v in report.items()}
    return out


def _fit_gemms(c: dict[str, Any], report: dict[str, Any], engine: str, system: str, hw, data) -> None:
    """1. GEMMs: per-layer sum of the 4 layer GEMMs, and the LM head."""
    peak, bw = hw.peak_flops, hw.hbm_bandwidth
    tok, targets, shapes, lm = [], [], [], []
    for r in data:
        m, tp = MODELS[r["model"]], r["tp"]
        t = _tokens(r)
        shapes.append([(m.hidden_size, (m.q_dim + 2 * m.kv_dim) // tp), (m.q_dim // tp, m.hidden_size),
                       (m.hidden_size, 2 * m.intermediate_size // tp), (m.intermediate_size // tp, m.hidden_size)])
        tok.append(t)
        targets.append(r["gemm"] * 1e-3 / m.num_layers)
        lm.append((r["batch"], m.hidden_size, m.vocab_size // tp, r["logits"] * 1e-3))
    tok_a, tgt = np.array(tok, float), np.array(targets)
    sh = np.array(shapes, float)
    lm_a = np.array(lm, float)

    def gemm_pred(p: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
        cc = EngineConstants.from_dict({**c, **p, "engine": engine, "system": system})
        layer = sum(gemm_times(cc, peak, bw, 2, tok_a, sh[:, i, 0], sh[:, i, 1]) for i in range(4))
        head = gemm_times(cc, peak, bw, 2, lm_a[:, 0], lm_a[:, 1], lm_a[:, 2])
        return layer, head

    def gemm_loss(p):
        layer, head = gemm_pred(p)
        return mape(tgt, layer) + 0.25 * mape(lm_a[:, 3], head)

    names = ("gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency", "gemm_overhead_s")
    c.update(_nm(gemm_loss, names, c))
    layer, head = gemm_pred({})
    report["gemm_mape"], report["lm_head_mape"] = mape(tgt, layer), mape(lm_a[:, 3], head)


def _fit_elementwise(c: dict[str, Any], report: dict[str, Any], hw, data) -> None:
    """2. element-wise kernels: norm (2 a layer) over tokens x hidden, act over tokens x inter/tp."""
    bw = hw.hbm_bandwidth
    for kind, col, per_layer in (("norm", "norm", 2), ("act", "act", 1)):
        elems, tgt_e = [], []
        for r in data:
            m = MODELS[r["model"]]
            width = m.hidden_size if kind == "norm" else m.intermediate_size // r["tp"]
            elems.append(_tokens(r) * width)
            tgt_e.append(r[col] * 1e-3 / (per_layer * m.num_layers))
        e_a, t_a = np.array(elems, float), np.array(tgt_e)

        def loss(p, e_a=e_a, t_a=t_a, kind=kind):
            return mape(t_a, p[f"{kind}_floor_s"] + e_a * p[f"{kind}_bytes_per_element"] / bw)

        c.update(_nm(loss, (f"{kind}_floor_s", f"{kind}_bytes_per_element"), c))
        report[f"{kind}_mape"] = loss(c)


def _fit_decode_attention(c: dict[str, Any], report: dict[str, Any], engine: str, system: str, hw,
                          data) -> None:
    """3. split-KV decode attention (the split cap chosen among SPLIT_CAPS)."""
    bw = hw.hbm_bandwidth
    dec = [r for r in data if r["phase"] == "decode"]
    b = np.array([r["batch"] for r in dec], float)
    ctx = np.array([r["length"] + 1 for r in dec], float)
    kv_heads = np.array([max(MODELS[r["model"]].num_kv_heads // r["tp"], 1) for r in dec], float)
    kv_local = kv_heads * np.array([MODELS[r["model"]].head_dim for r in dec], float)
    tgt_a = np.array([r["attention"] * 1e-3 / MODELS[r["model"]].num_layers for r in dec])

    def attn_pred(p, cap):
        cc = EngineConstants.from_dict({**c, **p, "decode_attn_max_splits": cap, "engine": engine,
                                        "system": system})
        return decode_attention_times(cc, bw, hw.num_sms, 2, kv_local, kv_heads, b, b * ctx, ctx)

    names = ("decode_attn_floor_s", "decode_attn_per_request_s", "decode_attn_efficiency", "decode_attn_key_s")
    best = None
    for cap in SPLIT_CAPS:
        p = _nm(lambda p, cap=cap: mape(tgt_a, attn_pred(p, cap)), names, c)
        err = mape(tgt_a, attn_pred(p, cap))
        if best is None or err < best[0]:
            best = (err, cap, p)
    report["decode_attention_mape"] = best[0]
    c.update(best[2])
    c["decode_attn_max_splits"] = best[1]


def _fit_prefill_attention(c: dict[str, Any], report: dict[str, Any], hw, data) -> None:
    """4. FlashAttention-3 prefill."""
    peak, bw = hw.peak_flops, hw.hbm_bandwidth
    pre = [r for r in data if r["phase"] == "prefill"]
    n = np.array([r["length"] for r in pre], float)
    bb = np.array([r["batch"] for r in pre], float)
    q_local = np.array([MODELS[r["model"]].q_dim // r["tp"] for r in pre], float)
    kvl = np.array([max(MODELS[r["model"]].num_kv_heads // r["tp"], 1) * MODELS[r["model"]].head_dim
                    for r in pre], float)
    tgt_p = np.array([r["attention"] * 1e-3 / MODELS[r["model"]].num_layers for r in pre])
    flops = bb * 4.0 * q_local * n * (n / 2.0)

    def pre_pred(p):
        work = flops + p["prefill_attn_half_tokens"] * flops / n
        memory = 2 * 2 * kvl * bb * n / (bw * c["decode_attn_efficiency"])
        return p["prefill_attn_floor_s"] + np.maximum(work / (peak * p["prefill_attn_efficiency"]), memory)

    names = ("prefill_attn_floor_s", "prefill_attn_efficiency", "prefill_attn_half_tokens")
    c.update(_nm(lambda p: mape(tgt_p, pre_pred(p)), names, c))
    report["prefill_attention_mape"] = mape(tgt_p, pre_pred(c))


def predict_row(cm, r: dict) -> float:
    """The model's time (ms) of one reference row's step."""
    if r["phase"] == "decode":
        ctx = r["length"] + 1
        return cm.decode_summary_time(r["batch"], r["batch"] * ctx, ctx) * 1e3
    return cm.prefill_time([(r["length"], 0)] * r["batch"]) * 1e3


def reference_ms(r: dict) -> float:
    return sum(r[k] for k in ("gemm", "logits", "attention", "norm", "act", "embedding", "allreduce"))


#: the groups of the headline table: (label, model, tp, phase)
GROUPS = (("decode 8B TP1", "llama-3.1-8b", 1, "decode"),
          ("decode 8B TP2", "llama-3.1-8b", 2, "decode"),
          ("decode 70B TP2", "llama-3.1-70b", 2, "decode"),
          ("decode 70B TP4", "llama-3.1-70b", 4, "decode"),
          ("decode 70B TP8", "llama-3.1-70b", 8, "decode"),
          ("prefill 8B TP1", "llama-3.1-8b", 1, "prefill"),
          ("prefill 8B TP2", "llama-3.1-8b", 2, "prefill"),
          ("prefill 70B TP2", "llama-3.1-70b", 2, "prefill"),
          ("prefill 70B TP4", "llama-3.1-70b", 4, "prefill"),
          ("prefill 70B TP8", "llama-3.1-70b", 8, "prefill"))


def legacy_model(model: str, hw: str, tp: int, phase: str):
    """The legacy analytic model as the comparison: CUDA-graph decode (no per-layer launch cost)."""
    from .analytic import AnalyticCostModel

    cm = AnalyticCostModel(MODELS[model], HARDWARE[hw], tp=tp)

    class _Graphed:
        def decode_summary_time(self, b, total, longest):
            return cm.decode_summary_time(b, total, longest) - cm.num_layers * cm.hw.layer_overhead_s

        def prefill_time(self, batch):
            return cm.prefill_time(batch)
    return _Graphed() if phase == "decode" else cm


def step_mape(rows: Sequence[dict] | None = None, engines: Sequence[str] = MEASURED_ENGINES,
              include_legacy: bool = True) -> list[dict[str, Any]]:
    """Per (engine, GPU, group) MAPE of whole-step times against aiconfigurator's composed steps;
    ``legacy`` rows score the legacy analytic model against the same engine's rows."""
    rows = load_reference_steps() if rows is None else rows
    out = []
    for engine in engines:
        for system, hw in ((s, HW_OF[s]) for s in ("h100_sxm", "h200_sxm")):
            for label, model, tp, phase in GROUPS:
                sel = [r for r in rows if r["backend"] == engine and r["system"] == system
                       and r["model"] == model and r["tp"] == tp and r["phase"] == phase]
                if not sel:
                    continue
                meas = [reference_ms(r) for r in sel]
                cm = EngineCostModel(MODELS[model], HARDWARE[hw], tp=tp, engine=engine)
                row = {"engine": engine, "gpu": hw, "group": label, "rows": len(sel),
                       "mape": mape(meas, [predict_row(cm, r) for r in sel])}
                if include_legacy:
                    leg = legacy_model(model, hw, tp, phase)
                    row["legacy_mape"] = mape(meas, [predict_row(leg, r) for r in sel])
                out.append(row)
    return out


def held_out_mape(engine: str = "vllm", rows: Sequence[dict] | None = None) -> list[dict[str, Any]]:
    """Leave one (model, TP) configuration out: fit on the others' rows, score the whole steps of
    the one left out (decode and prefill), per GPU."""
    rows = load_reference_steps() if rows is None else rows
    configs = sorted({(r["model"], r["tp"]) for r in rows if r["backend"] == engine})
    out = []
    for system in ("h100_sxm", "h200_sxm"):
        for model, tp in configs:
            train = [r for r in rows if not (r["model"] == model and r["tp"] == tp)]
            c = EngineConstants.from_dict(fit_one(engine, system, train))
            cm = EngineCostModel(MODELS[model], HARDWARE[HW_OF[system]], tp=tp, engine=engine, constants=c)
            for phase in ("decode", "prefill"):
                sel = [r for r in rows if r["backend"] == engine and r["system"] == system
                       and r["model"] == model and r["tp"] == tp and r["phase"] == phase]
                out.append({"engine": engine, "gpu": HW_OF[system], "held out": f"{phase} {model} TP{tp}",
                            "rows": len(sel), "mape": mape([reference_ms(r) for r in sel],
                                                           [predict_row(cm, r) for r in sel])})
    return out


def fit_engines(rows: Sequence[dict] | None = None) -> dict[str, Any]:
    rows = load_reference_steps() if rows is None else rows
    fits = [fit_one(e, s, rows) for e in MEASURED_ENGINES for s in ("h100_sxm", "h200_sxm")]
    return {"source": "aiconfigurator-core 0.12.0 per-operator tables (Apache-2.0), via "
                      "benchmarks/engine_tables.py; fitted by laneserve.costmodel.engine_fit",
            "fits": fits}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=str(FITS_PATH), help="where to write the fits JSON")
    args = p.parse_args(argv)
    report = fit_engines()
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    for fit in report["fits"]:
        print(fit["engine"], fit["system"], fit["fit_mape"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
