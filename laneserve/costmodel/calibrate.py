"""Calibration as code: fit every hardware term of the analytic cost model to the shared profiles
(docs/design.md, "Cost models"; ``laneserve calibrate`` or ``python -m laneserve.costmodel.calibrate``).

Stages, each minimising the mean absolute percentage error (MAPE) with Nelder-Mead in log space:

1. GEMMs (``gemm_efficiency_max``, ``gemm_half_tokens``, ``memory_efficiency``,
   ``gemm_overhead_s``): Vidur's Llama-2-7B linear operators (H100, tp=1, 1-4096 tokens) and
   LLMServingSim's Llama-3.1-8B q/k/v/o/gate/up/down GEMMs (1-2048 tokens). Vidur's Llama-2-70B
   files (H100 and A100, tp 1/2/4/8) are *not* fitted on: they are the held-out check.
2. FlashAttention kernel (``attn_*``): the packaged sample of LLMServingSim's H100 Llama-3.1-70B
   tp4 attention profile (``data/``, see its NOTICE), rows at KV 3968 / 21248 / 64000 and every
   prefill row; the decode rows at KV 3904 / 21760 / 63488 / 65536 are held out. Tile 64 keys is
   read off the profile (times step every 64 KV tokens), not fitted. The sample's decode kernel is
   scored with one block per query head, as its wave steps show (:func:`attention_sample_model`);
   the simulator's default packed-GQA decode reuses the per-tile constants (an assumption: the
   sample has one query/KV ratio and one kernel, so it cannot show a packed kernel's cost).
3. Prefill attention roofline (``attention_efficiency``): LLMServingSim's ``attn`` rows, >= 256
   tokens (the file has no KV > 0 rows).
4. Small kernels (``kernel_floor_s``, ``elementwise_bytes_per_element``): Vidur's Llama-2-7B
   norm / rotary / activation / residual-add operators (H100, tp 1; fused vLLM kernels, each
   ``floor + elements * bytes / bw``); the Llama-2-70B files are the held-out check.
5. What the eager engine adds (``eager_bytes_per_element``, ``layer_overhead_s``): LLMServingSim
   whole-model prefill totals (an HF-eager profile whose unfused norms and rotary cost 17-27 us a kernel
   group; LM head on the last token only; GPU time, no host cost), the other terms fixed.
6. All-reduce per GPU count (``floor``, ``latency``, ``bandwidth``): Vidur's H100 and A100 DGX
   all-reduce profiles, one node (``devices_per_node == num_workers``); each hardware on its own
   file, and the H100 fit is also scored on the A100 file (cross-hardware, not fitted).
7. Host overhead per iteration (``base_s``, ``per_seq_s``, ``tp_s``): Vidur's A100 CPU overheads
   (schedule + sampler + prepare inputs + process outputs medians, + Ray messaging mean), fitted
   on Llama-2-7B (tp 1) and Llama-2-70B (tp 4); the other four models are held out.

The fitted constants are written as :mod:`laneserve.costmodel.fitted_constants` (a generated
Python module: nothing reads a file at import) with ``--write-constants``; the report (constants
plus per-file MAPE, fitted vs held-out) as JSON with ``--output``.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from .analytic import AnalyticCostModel
from .profile import (LLMSS_LINEAR, llmss_prefill_seconds, load_llmservingsim_layers,
                      load_vidur_mlp, open_profile_csv)
from .specs import H100_SXM, MODELS, HardwareSpec, HostOverhead, LinkSpec, fit_link, fit_send_recv

VIDUR_FILE = "vidur_h100_llama2_7b_mlp.csv"
LLMSS_FILE = "llmservingsim_h100_llama31_8b_tp1_layers.csv"
SEND_RECV_FILE = "vidur_h100_dgx_send_recv.csv"
VIDUR_70B_FILES = {"h100": "vidur_h100_llama2_70b_mlp.csv", "a100": "vidur_a100_llama2_70b_mlp.csv"}
ALLREDUCE_FILES = {"h100": "vidur_h100_dgx_all_reduce.csv", "a100": "vidur_a100_dgx_all_reduce.csv"}
CPU_FILE = "vidur_a100_cpu_overheads.csv"
ATTENTION_SAMPLE = Path(__file__).resolve().parent / "data/llmservingsim_h100_llama31_70b_tp4_attention_sample.csv"
CONSTANTS_MODULE = Path(__file__).resolve().parent / "fitted_constants.py"
#: decode KV sizes of the attention sample that are held out of the fit
ATTENTION_HELD_OUT_KV = (3904, 21760, 63488, 65536)
#: models of the CPU-overhead profile the host term is fitted on (the others are held out)
HOST_FIT_MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf")
HOST_COLUMNS = ("schedule_median", "sampler_e2e_median", "prepare_inputs_e2e_median",
                "process_model_outputs_median", "ray_comm_time_mean")
#: vidur operator -> our operator
VIDUR_LINEAR = {"attn_pre_proj": "qkv_proj", "attn_post_proj": "o_proj",
                "mlp_up_proj": "gate_up", "mlp_down_proj": "down"}
#: Vidur's small (element-wise) operators of one layer
VIDUR_SMALL = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
CALIBRATED_FIELDS = ("gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency",
                     "attention_efficiency", "elementwise_bytes_per_element", "gemm_overhead_s",
                     "kernel_floor_s", "eager_bytes_per_element", "layer_overhead_s")
ATTENTION_FIELDS = ("attn_key_s", "attn_block_s", "attn_shared_factor", "attn_floor_s")


PACKAGED_PROFILES = Path(__file__).resolve().parent / "data"
#: every measured profile the calibration reads (packaged gzipped in ``data/``; see ``data/NOTICE.md``)
PROFILE_FILES = (VIDUR_FILE, LLMSS_FILE, SEND_RECV_FILE, *VIDUR_70B_FILES.values(),
                 *ALLREDUCE_FILES.values(), CPU_FILE)


def default_profiles_dir() -> Path:
    """The measured profiles packaged with laneserve (``laneserve/costmodel/data``, gzipped)."""
    missing = [name for name in PROFILE_FILES
               if not (PACKAGED_PROFILES / name).exists() and not (PACKAGED_PROFILES / f"{name}.gz").exists()]
    if missing:
        raise FileNotFoundError(f"packaged profiles missing from {PACKAGED_PROFILES}: {', '.join(missing)}; "
                                "pass --profiles DIR")
    return PACKAGED_PROFILES


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


# --- attention sample ------------------------------------------------------------------------------

def load_attention_sample(path: Path = ATTENTION_SAMPLE) -> list[dict]:
    """Rows ``{"prefill": bool, "batch": int, "chunk": int, "kv": int, "seconds": float}``; ``kv``
    is the KV of the whole batch (see the data NOTICE)."""
    with open(path, newline="") as f:
        return [{"prefill": r["is_prefill"] == "True", "batch": int(r["batch_size"]),
                 "chunk": int(r["prefill_chunk_size"]), "kv": int(r["kv_cache_size"]),
                 "seconds": float(r["median_ms"]) * 1e-3} for r in csv.DictReader(f)]


def attention_sample_model(hw: HardwareSpec, decode_kernel: str = "per_query_head") -> AnalyticCostModel:
    """The sample's setup: Llama-3.1-70B at tp 4 (16 query heads, 2 KV heads per GPU). Its decode
    kernel launches a block per query head: the measured time steps up after batch 8, 16, 24 and
    33, where ``16 * batch`` passes a multiple of the 132 SMs (2 blocks a request would step every
    66 requests). ``decode_kernel="gqa_packed"`` scores the packed-GQA assumption on it instead."""
    return AnalyticCostModel(MODELS["llama-3.1-70b"], hw, tp=4, decode_kernel=decode_kernel)


def predict_attention_row(cm: AnalyticCostModel, row: dict) -> float:
    if row["prefill"]:
        return cm.prefill_attention_time([(row["chunk"], row["kv"] - row["chunk"])])
    return cm.decode_attention_time([row["kv"] // row["batch"]] * row["batch"])


def attention_split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(fitted rows, held-out rows): decode rows at :data:`ATTENTION_HELD_OUT_KV` are held out."""
    held = [r for r in rows if not r["prefill"] and r["kv"] in ATTENTION_HELD_OUT_KV]
    return [r for r in rows if r not in held], held


def attention_mape(hw: HardwareSpec, rows: list[dict]) -> float:
    cm = attention_sample_model(hw)
    return mape([r["seconds"] for r in rows], [predict_attention_row(cm, r) for r in rows])


# --- all-reduce --------------------------------------------------------------------------------------

def load_allreduce(path: Path) -> dict[int, list[tuple[int, float]]]:
    """``{gpus: [(bytes, median seconds), ...]}`` of one-node all-reduces."""
    out: dict[int, list[tuple[int, float]]] = {}
    with open_profile_csv(path) as f:
        for r in csv.DictReader(f):
            if r["num_workers"] == r["devices_per_node"]:
                out.setdefault(int(r["num_workers"]), []).append(
                    (int(r["size"]), float(r["time_stats.all_reduce.median"]) * 1e-3))
    return out


def fit_allreduce_link(samples: Sequence[tuple[int, float]]) -> LinkSpec:
    """``max(floor, latency + bytes / bandwidth)`` minimising MAPE (started from the least-squares
    line and the median time of the messages up to 1 MB)."""
    data = np.asarray(samples, float)
    x, y = data[:, 0], data[:, 1]
    start = fit_link(samples)
    small = y[x <= 2**20]
    floor0 = float(np.median(small)) if len(small) else start.latency

    def loss(v: np.ndarray) -> float:
        floor, lat, bw = np.exp(v)
        return float(np.mean(np.abs(np.maximum(floor, lat + x / bw) - y) / y))

    best = nelder_mead(loss, np.log([floor0, max(start.latency, 1e-6), start.bandwidth]), iters=2000)
    floor, lat, bw = np.exp(best)
    return LinkSpec(bandwidth=float(bw), latency=float(lat), floor=float(floor))


def allreduce_mape(table: dict[int, LinkSpec], data: dict[int, list[tuple[int, float]]]) -> dict[int, float]:
    return {n: mape([t for _, t in pts], [table[n].transfer_time(b) for b, _ in pts])
            for n, pts in sorted(data.items()) if n in table}


# --- host overhead -----------------------------------------------------------------------------------

def load_cpu_overheads(path: Path) -> list[tuple[str, int, int, float]]:
    """``(model, batch_size, tp, seconds)`` per row: the sum of :data:`HOST_COLUMNS`."""
    with open_profile_csv(path) as f:
        return [(r["model_name"], int(r["batch_size"]), int(r["tensor_parallel_degree"]),
                 sum(float(r[c]) for c in HOST_COLUMNS) * 1e-3) for r in csv.DictReader(f)]


def fit_host_overhead(rows: Sequence[tuple[str, int, int, float]]) -> HostOverhead:
    """Least squares of ``base + per_seq * batch + tp_s * [tp > 1]`` weighted by 1/seconds."""
    design = np.array([[1.0, b, 1.0 if tp > 1 else 0.0] for _, b, tp, _ in rows])
    y = np.array([t for *_, t in rows])
    coef, *_ = np.linalg.lstsq(design / y[:, None], np.ones_like(y), rcond=None)
    return HostOverhead(base_s=float(coef[0]), per_seq_s=float(coef[1]), tp_s=float(coef[2]))


# --- the whole calibration -----------------------------------------------------------------------

def _fit_gemm(hw: HardwareSpec, profiles: Path, llmss: dict[int, dict[str, float]]) -> HardwareSpec:
    vidur = [r for r in load_vidur_mlp(profiles / VIDUR_FILE) if r.tp == 1]
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

    return _fit(hw, ("gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency",
                     "gemm_overhead_s"), gemm_loss)


def calibrate(profiles: Path | None = None, hw: HardwareSpec = H100_SXM) -> HardwareSpec:
    """Stages 1-4: the H100 compute terms (GEMM, FlashAttention, attention roofline, the rest)."""
    profiles = Path(profiles) if profiles else default_profiles_dir()
    llmss = _llmss_kv0(profiles)
    l31 = MODELS["llama-3.1-8b"]
    hw = _fit_gemm(hw, profiles, llmss)

    fit_rows, _ = attention_split(load_attention_sample())
    hw = _fit(hw, ATTENTION_FIELDS, lambda c: attention_mape(c, fit_rows))

    long_rows = [(n, ops["attn"]) for n, ops in llmss.items() if n >= 256]
    hw = _fit(hw, ("attention_efficiency",), lambda c: mape(
        [t for _, t in long_rows],
        [AnalyticCostModel(l31, c).prefill_attention_time([(n, 0)]) for n, _ in long_rows]))

    small = small_op_pairs(load_vidur_mlp(profiles / VIDUR_FILE), MODELS["llama-2-7b"], tp=1)
    hw = _fit(replace(hw, kernel_floor_s=hw.kernel_floor_s or 2e-6),
              ("kernel_floor_s", "elementwise_bytes_per_element"), lambda c: small_op_mape(c, small))

    lm_last = llmss[1]["lm_head"]
    totals = [(n, llmss_prefill_seconds(ops, l31.num_layers, lm_head_seconds=lm_last))
              for n, ops in list(llmss.items())[::4]]
    hw = _fit(replace(hw, eager_bytes_per_element=hw.eager_bytes_per_element or 10.0),
              ("eager_bytes_per_element", "layer_overhead_s"), lambda c: mape(
        [t for _, t in totals],
        [AnalyticCostModel(l31, c, host_overhead=False).prefill_time([(n, 0)]) for n, _ in totals]))
    return hw


def small_op_pairs(rows, model, tp: int) -> list[tuple[int, float]]:
    """``(elements, measured seconds)`` of the five small operators of one layer together
    (:data:`VIDUR_SMALL`), per Vidur row at degree ``tp``: the norms and the residual add touch
    ``hidden`` elements a token, rotary the local q + k heads, the activation the local
    intermediate width. Summed per layer because single ones sit at the profile's 1 us
    resolution, and a step pays their sum."""
    kv_local = max(model.num_kv_heads // tp, 1) * model.head_dim
    width = 3 * model.hidden_size + model.q_dim // tp + kv_local + model.intermediate_size // tp
    return [(r.num_tokens * width, sum(r.op_seconds[op] for op in VIDUR_SMALL))
            for r in rows if r.tp == tp]


def small_op_mape(hw: HardwareSpec, pairs: Sequence[tuple[int, float]]) -> float:
    """MAPE of the five small kernels of a layer: ``5 * kernel_floor_s + elements * bytes / bw``."""
    per_elem = hw.elementwise_bytes_per_element / hw.hbm_bandwidth
    return mape([t for _, t in pairs],
                [len(VIDUR_SMALL) * hw.kernel_floor_s + n * per_elem for n, _ in pairs])


def linear_70b_mape(hw: HardwareSpec, path: Path) -> dict[int, float]:
    """MAPE of the four linear operators of one Llama-2-70B layer per TP degree (Vidur file)."""
    rows = load_vidur_mlp(path)
    out: dict[int, float] = {}
    for tp in sorted({r.tp for r in rows}):
        cm = AnalyticCostModel(MODELS["llama-2-70b"], hw, tp=tp)
        meas, pred = [], []
        for r in (r for r in rows if r.tp == tp):
            ops = cm.linear_op_times(r.num_tokens)
            for vop, op in VIDUR_LINEAR.items():
                meas.append(r.op_seconds[vop]), pred.append(ops[op])
        out[tp] = mape(meas, pred)
    return out


def calibrate_all(profiles: Path | None = None) -> dict:
    """Every stage; returns the report: ``{"constants": ..., "mape": ..., "notes": ...}``."""
    profiles = Path(profiles) if profiles else default_profiles_dir()
    h100 = calibrate(profiles)
    ar_data = {hw: load_allreduce(profiles / f) for hw, f in ALLREDUCE_FILES.items()}
    allreduce = {hw: {n: fit_allreduce_link(pts) for n, pts in data.items() if n in (2, 4, 8)}
                 for hw, data in ar_data.items()}
    cpu = load_cpu_overheads(profiles / CPU_FILE)
    host = fit_host_overhead([r for r in cpu if r[0] in HOST_FIT_MODELS])
    a100 = replace(h100, name="a100", peak_flops=312e12, hbm_bandwidth=2.039e12, num_sms=108,
                   attn_key_s=h100.attn_key_s * h100.hbm_bandwidth / 2.039e12)

    fit_rows, held_rows = attention_split(load_attention_sample())
    host_by_model: dict[str, tuple[list[float], list[float]]] = {}
    for name, batch, tp, secs in cpu:
        m, p = host_by_model.setdefault(name, ([], []))
        m.append(secs), p.append(host.time(batch, tp))
    report_mape = {
        "linear_llama2_70b_h100 (held out)": linear_70b_mape(h100, profiles / VIDUR_70B_FILES["h100"]),
        "linear_llama2_70b_a100 (held out)": linear_70b_mape(a100, profiles / VIDUR_70B_FILES["a100"]),
        "small_ops_llama2_7b_h100 (fitted, tp 1)": small_op_mape(
            h100, small_op_pairs(load_vidur_mlp(profiles / VIDUR_FILE), MODELS["llama-2-7b"], 1)),
        **{f"small_ops_llama2_70b_{name} (held out)": {
            tp: small_op_mape(hw, small_op_pairs(load_vidur_mlp(profiles / VIDUR_70B_FILES[name]),
                                                 MODELS["llama-2-70b"], tp)) for tp in (1, 2, 4, 8)}
           for name, hw in (("h100", h100), ("a100", a100))},
        "allreduce_h100 (fitted)": allreduce_mape(allreduce["h100"], ar_data["h100"]),
        "allreduce_a100 (fitted)": allreduce_mape(allreduce["a100"], ar_data["a100"]),
        "allreduce_a100_with_h100_fit (held out)": allreduce_mape(allreduce["h100"], ar_data["a100"]),
        "attention_llama31_70b_tp4_h100 (fitted rows)": attention_mape(h100, fit_rows),
        "attention_llama31_70b_tp4_h100 (held-out rows)": attention_mape(h100, held_rows),
        "host_overhead_a100": {f"{name} ({'fitted' if name in HOST_FIT_MODELS else 'held out'})":
                               mape(m, p) for name, (m, p) in sorted(host_by_model.items())},
    }
    return {
        "profiles": str(profiles),
        "constants": {
            "H100_CALIBRATION": {k: float(getattr(h100, k)) for k in CALIBRATED_FIELDS},
            "H100_ATTENTION": {**{k: float(getattr(h100, k)) for k in ATTENTION_FIELDS},
                               "attn_tile_keys": h100.attn_tile_keys},
            "ALLREDUCE": {hw: {n: [link.latency, link.bandwidth, link.floor]
                               for n, link in sorted(t.items())}
                          for hw, t in allreduce.items()},
            "HOST_OVERHEAD": asdict(host),
            "links_send_recv_h100": {name: [link.latency, link.bandwidth] for name, link in
                                     fit_send_recv(str(profiles / SEND_RECV_FILE)).items()},
        },
        "mape": report_mape,
    }


def constants_module(report: dict) -> str:
    """The source of :mod:`laneserve.costmodel.fitted_constants` for a calibration report."""
    c = report["constants"]

    def fmt(v):
        return repr(v) if isinstance(v, int) else f"{v:.4g}"

    lines = ['"""Fitted hardware constants of the analytic cost model. GENERATED by `laneserve calibrate',
             '--write-constants` from the shared profiles; do not edit by hand (re-run the command)."""',
             ""]
    for name in ("H100_CALIBRATION", "H100_ATTENTION"):
        lines.append(f"{name} = {{")
        lines += [f"    {k!r}: {fmt(v)}," for k, v in c[name].items()]
        lines.append("}")
    lines.append("ALLREDUCE = {  # gpus: [latency s, bandwidth B/s, floor s]")
    for hw, table in c["ALLREDUCE"].items():
        inner = ", ".join(f"{n}: [{fmt(lat)}, {fmt(bw)}, {fmt(fl)}]" for n, (lat, bw, fl) in table.items())
        lines.append(f"    {hw!r}: {{{inner}}},")
    lines.append("}")
    inner = ", ".join(f"{k!r}: {fmt(v)}" for k, v in c["HOST_OVERHEAD"].items())
    lines.append(f"HOST_OVERHEAD = {{{inner}}}")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profiles", type=Path, default=None,
                        help="folder of the measured profiles, as CSV or CSV.gz (default: the packaged ones)")
    parser.add_argument("--output", type=Path, default=None,
                        help="write the report (constants and per-file MAPE) as JSON here")
    parser.add_argument("--write-constants", action="store_true",
                        help="regenerate laneserve/costmodel/fitted_constants.py from the fit")


def run(args: argparse.Namespace) -> int:
    report = calibrate_all(args.profiles)
    text = json.dumps(report, indent=1, default=str)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if args.write_constants:
        CONSTANTS_MODULE.write_text(constants_module(report))
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
