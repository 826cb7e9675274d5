"""How well the analytic cost model matches measured H100 profiles (DESIGN.md, "Cost models").

Metrics (mean absolute percentage error, MAPE):
* ``prefill_mape_llama31_8b``: Llama-3.1-8B prefill of 64-2048 tokens, whole-model sums of
  LLMServingSim's per-operator latencies (kv_cache=0; LM head taken at its 1-token cost, because
  the model computes logits for the last token only) vs ``AnalyticCostModel.prefill_time``.
* ``linear_mape_llama2_7b``: Vidur's per-layer linear operators of Llama-2-7B (tp=1, 1-4096
  tokens), each operator sample on its own, vs the model's per-layer GEMM times.
* extras: the same with the profiled all-token LM head, Vidur at tp=2/4/8, the single-token step.

    python benchmarks/cost_calibration.py [--profiles DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from laneserve.costmodel import AnalyticCostModel, get_hardware_spec, get_model_spec  # noqa: E402
from laneserve.costmodel.calibrate import (LLMSS_FILE, VIDUR_FILE, VIDUR_LINEAR,  # noqa: E402
                                           mape)
from laneserve.costmodel.profile import (llmss_prefill_seconds, load_llmservingsim_layers,  # noqa: E402
                                         load_vidur_mlp)

DEFAULT_PROFILES = REPO.parent / "shared/data/profiles"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES)
    args = parser.parse_args()
    profiles: Path = args.profiles
    for name in (VIDUR_FILE, LLMSS_FILE):
        if not (profiles / name).exists():
            sys.exit(f"error: {profiles / name} not found; pass --profiles DIR "
                     "(the shared/data/profiles folder)")
    h100 = get_hardware_spec("h100")
    l31 = AnalyticCostModel(get_model_spec("llama-3.1-8b"), h100)
    l2_spec = get_model_spec("llama-2-7b")

    table = load_llmservingsim_layers(profiles / LLMSS_FILE)
    kv0 = {n: ops for (n, kv, tp), ops in sorted(table.items()) if kv == 0 and tp == 1}
    lm_last = kv0[1]["lm_head"]
    tokens = [n for n in kv0 if 64 <= n <= 2048]
    meas = [llmss_prefill_seconds(kv0[n], l31.num_layers, lm_head_seconds=lm_last) for n in tokens]
    meas_all_lm = [llmss_prefill_seconds(kv0[n], l31.num_layers) for n in tokens]
    model = [l31.prefill_time([(n, 0)]) for n in tokens]

    vidur = load_vidur_mlp(profiles / VIDUR_FILE)
    linear: dict[int, tuple[list[float], list[float]]] = {}
    per_op: dict[str, tuple[list[float], list[float]]] = {op: ([], []) for op in VIDUR_LINEAR.values()}
    for row in vidur:
        ops = AnalyticCostModel(l2_spec, h100, tp=row.tp).linear_op_times(row.num_tokens)
        m, p = linear.setdefault(row.tp, ([], []))
        for vop, op in VIDUR_LINEAR.items():
            m.append(row.op_seconds[vop]), p.append(ops[op])
            if row.tp == 1:
                per_op[op][0].append(row.op_seconds[vop]), per_op[op][1].append(ops[op])

    decode_rows = {k: v for k, v in table.items() if k[1] > 0}
    one_token = llmss_prefill_seconds(kv0[1], l31.num_layers)
    metrics = {
        "prefill_mape_llama31_8b": mape(meas, model),
        "linear_mape_llama2_7b": mape(*linear[1]),
        "prefill_mape_llama31_8b_all_token_lm_head": mape(meas_all_lm, model),
        "prefill_max_ape_llama31_8b": max(abs(p - m) / m for m, p in zip(meas, model)),
        **{f"linear_mape_llama2_7b_tp{tp}": mape(*linear[tp]) for tp in sorted(linear) if tp > 1},
        **{f"linear_mape_llama2_7b_{op}": mape(*mp) for op, mp in per_op.items()},
        "single_token_step_ape_llama31_8b": abs(l31.decode_step_time([1]) - one_token) / one_token,
        "decode_rows_in_profile": len(decode_rows),
        "prefill_samples": len(tokens),
        "linear_op_samples_tp1": len(linear[1][0]),
    }
    rows = [{"tokens": n, "measured_ms": meas[i] * 1e3, "model_ms": model[i] * 1e3,
             "error_%": 100 * (model[i] - meas[i]) / meas[i]}
            for i, n in enumerate(tokens) if n in (64, 128, 256, 512, 768, 1024, 1536, 2048)]
    lin_rows = []
    seen: set[int] = set()
    for row in (r for r in vidur if r.tp == 1 and r.num_tokens in (1, 64, 256, 1024, 4096)):
        if row.num_tokens in seen:
            continue
        seen.add(row.num_tokens)
        ops = AnalyticCostModel(l2_spec, h100).linear_op_times(row.num_tokens)
        lin_rows.append({"tokens": row.num_tokens, **{
            f"{op} meas/model us": f"{row.op_seconds[v] * 1e6:.0f}/{ops[op] * 1e6:.0f}"
            for v, op in VIDUR_LINEAR.items()}})
    markdown = ("## Llama-3.1-8B prefill (LLMServingSim H100, kv_cache=0)\n\n" + markdown_table(rows)
                + "\n## Llama-2-7B linear operators per layer (Vidur H100, tp=1)\n\n"
                + markdown_table(lin_rows)
                + "\nThe LLMServingSim profile has no kv_cache > 0 rows, so there is no decode-vs-"
                  "context check; `single_token_step_ape` compares one 1-token step.\n"
                + "\n![measured vs model](cost_calibration.png)\n")
    plot(tokens, meas, model, vidur, l2_spec, h100)
    write_result("cost_calibration", metrics, markdown=markdown,
                 extra={"hardware_calibration": {k: getattr(h100, k) for k in (
                     "gemm_efficiency_max", "gemm_half_tokens", "memory_efficiency",
                     "attention_efficiency", "elementwise_bytes_per_element", "gemm_overhead_s",
                     "layer_overhead_s")}})
    for k, v in metrics.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def plot(tokens, meas, model, vidur, l2_spec, h100) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(tokens, [m * 1e3 for m in meas], label="measured (LLMServingSim)", lw=1)
    ax1.plot(tokens, [m * 1e3 for m in model], label="analytic model", lw=1.5, ls="--")
    ax1.set(xlabel="prompt tokens", ylabel="prefill time (ms)", title="Llama-3.1-8B prefill, H100")
    ax1.legend()
    rows = sorted((r for r in vidur if r.tp == 1), key=lambda r: r.num_tokens)
    xs = [r.num_tokens for r in rows]
    cm = AnalyticCostModel(l2_spec, h100)
    pred = [cm.linear_op_times(n) for n in xs]
    for vop, op in VIDUR_LINEAR.items():
        line, = ax2.plot(xs, [r.op_seconds[vop] * 1e3 for r in rows], lw=1, label=f"{op} measured")
        ax2.plot(xs, [p[op] * 1e3 for p in pred], lw=1.5, ls="--", color=line.get_color())
    ax2.set(xscale="log", yscale="log", xlabel="tokens", ylabel="time (ms)",
            title="Llama-2-7B linear ops / layer (Vidur, tp=1); dashed = model")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS_DIR / "cost_calibration.png", dpi=120)


if __name__ == "__main__":
    main()
