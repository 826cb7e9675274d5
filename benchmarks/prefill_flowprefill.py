"""FlowPrefill's setup (flowprefill.txt §6.1–6.3) in the simulator: S-EDF with operator-level
preemption vs FCFS (DistServe), CP-EDF 2K and CP-EDF 8K, plus the ablations.

Llama-3-8B on the H100 analytic cost model, 1 prefill + 1 decode instance (continuous batching
decode), the four-class mix (Table 1 prompt lengths and ratios, Table 2 TTFT SLOs for Llama3-8B:
Text 0.25 s, Image 0.5 s, Search 4 s, File 6 s) with Poisson arrivals. The metric is **TTFT SLO
attainment** (the paper's primary metric, §6.1 "Metrics"); goodput = the highest rate with ≥ 90%
TTFT attainment (rate search; mean over three workload seeds for the four main policies), the tightest SLO scale = the smallest factor on Table 2 that still
reaches 90% at a fixed rate.

    python benchmarks/prefill_flowprefill.py

Predictors and context: this reproduction pins ``predictor="oracle"`` (the policies
read the cost model that charges the time, as before the honest-predictor default) and
``max_model_len=0`` (no context check: the paper setups run prompts longer than the spec's
context), so its figures stay comparable with the paper's and with earlier runs.
"""

from __future__ import annotations

import time

from laneserve.bench.experiment import goodput, run_point, tightest_slo_scale
from laneserve.bench.report import plot_curves
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig
from laneserve.workloads import make_workload

N_REQUESTS = 1500
#: workload samples for the main goodputs: one 1500-request sample is noisy for FCFS (its goodput
#: hinges on rare bursts of long prompts), so goodputs are averaged over three seeds; the per-seed
#: figures are reported beside the mean. Curves, SLO scales and ablations use seed 0.
SEEDS = (0, 1, 2)
METRIC = "attainment_ttft"
SCALE_RATE = 8.0                      # req/s for the SLO-scale search
RATES = (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28)
MAIN = {"FCFS (DistServe)": "fcfs", "CP-EDF 2K": "cp-edf-2k", "CP-EDF 8K": "cp-edf-8k",
        "S-EDF + operator preemption": "sedf"}
ABLATIONS = {
    "naive EDF": "sedf:ordering=edf", "D-EDF": "sedf:ordering=dedf",
    "no batching": "sedf:batching=false", "G=2K": "sedf:token_budget=2048",
    "G=4K (default)": "sedf:token_budget=4096", "G=8K": "sedf:token_budget=8192",
    "layer preemption": "sedf:preemption=layer", "chunk 2K preemption": "sedf:preemption=chunk,chunk=2048",
    "chunk 8K preemption": "sedf:preemption=chunk,chunk=8192", "no preemption": "sedf:preemption=none",
}


#: the SLO-scale search runs for the baselines and the ordering ablations (paper Figures 9–10)
SCALE_SEARCH = (*MAIN, "naive EDF", "D-EDF")


def main() -> None:
    t0 = time.perf_counter()
    cost = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
    workloads = {seed: make_workload("flowprefill_mix", model="Llama3-8B", n=N_REQUESTS, seed=seed)
                 for seed in SEEDS}
    wl = workloads[0]
    configs = {name: ClusterConfig(predictor="oracle", max_model_len=0, prefill_policy=spec) for name, spec in {**MAIN, **ABLATIONS}.items()}

    curve = []
    for name in MAIN:
        for rate in RATES:
            s, res = run_point(wl, configs[name], cost, rate=rate)
            curve.append({"policy": name, "rate": rate, METRIC: s[METRIC],
                          **{f"{c}_attainment": s["per_class"][c]["attainment_ttft"]
                             for c in ("Text", "Image", "Search", "File") if c in s.get("per_class", {})},
                          "p99_ttft_ms": s["p99_ttft_ms"],
                          "preemptions": sum(i["preemptions"] for i in s["instances"])})
        print(f"curve {name}: " + " ".join(f"{r[METRIC]:.3f}" for r in curve if r["policy"] == name), flush=True)

    rows = []
    for name, config in configs.items():
        seeds = SEEDS if name in MAIN else SEEDS[:1]
        per_seed = [goodput(workloads[seed], config, cost, lo=0.5, hi=64.0, metric=METRIC, rel_tol=0.03).value
                    for seed in seeds]
        sc = (tightest_slo_scale(wl, config, cost, rate=SCALE_RATE, metric=METRIC, rel_tol=0.03)
              if name in SCALE_SEARCH else None)
        scale = sc.value if sc is not None and sc.met else None
        rows.append({"policy": name, "spec": config.prefill_policy, "goodput_rps": sum(per_seed) / len(per_seed),
                     "goodput_per_seed": per_seed, "tightest_slo_scale": scale})
        print(f"{name:30s} goodput {per_seed} req/s  tightest SLO scale @ {SCALE_RATE:g} req/s: "
              f"{scale}", flush=True)
    by = {r["policy"]: r for r in rows}
    sedf = by["S-EDF + operator preemption"]
    per_seed_fcfs = [a / b for a, b in zip(sedf["goodput_per_seed"], by["FCFS (DistServe)"]["goodput_per_seed"])]
    per_seed_cp2k = [a / b for a, b in zip(sedf["goodput_per_seed"], by["CP-EDF 2K"]["goodput_per_seed"])]
    metrics = {
        "metric": "TTFT SLO attainment >= 90% (FlowPrefill §6.1)",
        "goodput_over_fcfs": sedf["goodput_rps"] / by["FCFS (DistServe)"]["goodput_rps"],
        "goodput_over_cp2k": sedf["goodput_rps"] / by["CP-EDF 2K"]["goodput_rps"],
        "goodput_over_cp8k": sedf["goodput_rps"] / by["CP-EDF 8K"]["goodput_rps"],
        "goodput_over_fcfs_per_seed": per_seed_fcfs,
        "goodput_over_cp2k_per_seed": per_seed_cp2k,
        "goodput_over_fcfs_min_seed": min(per_seed_fcfs),
        "goodput_over_cp2k_min_seed": min(per_seed_cp2k),
        "slo_tighter_than_cp2k": by["CP-EDF 2K"]["tightest_slo_scale"] / sedf["tightest_slo_scale"],
        "slo_tighter_than_cp8k": by["CP-EDF 8K"]["tightest_slo_scale"] / sedf["tightest_slo_scale"],
        **{f"goodput_rps[{r['policy']}]": r["goodput_rps"] for r in rows},
        **{f"tightest_slo_scale[{r['policy']}]": r["tightest_slo_scale"] for r in rows},
        "wall_seconds": time.perf_counter() - t0,
    }
    plot_curves(RESULTS_DIR / "prefill_flowprefill.png", curve, x_key="rate", y_keys=(METRIC,),
                group_key="policy", title="FlowPrefill mix, Llama-3-8B / H100, 1P1D")
    md = ("Paper (§6.2): 4.7–5.6× DistServe goodput, up to 2.0× CP2K and 4.5× CP8K; 1.5–2.3× tighter "
          "SLOs than CP2K.\n\n## Goodput and tightest SLO scale\n\n" + markdown_table(rows)
          + f"\n## TTFT attainment vs rate ({N_REQUESTS} requests per point)\n\n" + markdown_table(curve)
          + "\n![attainment vs rate](prefill_flowprefill.png)\n")
    write_result("prefill_flowprefill", metrics, markdown=md,
                 extra={"rows": rows, "curve": curve, "n_requests": N_REQUESTS, "scale_rate": SCALE_RATE,
                        "seeds": SEEDS,
                        "setup": "Llama-3-8B, H100 analytic cost model, 1 prefill + 1 decode (continuous), "
                                 "flowprefill_mix, Poisson arrivals"})
    print({k: v for k, v in metrics.items() if not k.startswith(("goodput_rps", "tightest"))})


if __name__ == "__main__":
    main()
