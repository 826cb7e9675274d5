"""Kairos' prefill setup (kairos.txt §4) in the simulator: urgency prefill vs FCFS (DistServe) and
CP-EDF on a long-tail trace, TTFT attainment vs rate.

Setup and choices:

- **Trace: Mooncake conversation** (bundled), the first ``N_REQUESTS`` requests. Kairos' own trace
  is a private long-tail production trace with prompts up to 128K tokens; Mooncake's lengths have
  that shape (p50 6.9K, p99 85K, max 126K tokens) while the Azure conversation trace tops out at
  14K. Mooncake's timestamps are quantised to ~3 s ticks (89% of gaps are zero: bursts of ~10
  simultaneous requests that survive any rescaling and make attainment flat in rate), so the
  lengths are kept and arrivals are redrawn as a Poisson process (``SEEDS``; the attainment
  curves are averaged over the seeds before the knee is located, and each seed's knee is
  reported too). Prefix caching is off (every prompt token is computed) for all policies.
- **SLO.** The paper's 8 s TTFT is for MiniMax-M2.5 on TP4 H200s (§2.2: 8K tokens prefill in
  0.40 s, 128K in 8.8 s: T = 0.40 s · (n/8K)^1.11). Our Llama-3-8B/H100 prefill time grows much
  faster with length (×106 from 8K to 128K, quadratic attention, vs ×22), so no single factor
  keeps every property of the paper's setup; which one is kept decides the result:
  * **equal reach (headline)**: the SLO is our prefill time of the longest prompt the paper's SLO
    can afford (T_paper(n*) = 8 s, n* ≈ 120K tokens). This keeps the property the paper's results
    show — at low load *every* request meets the SLO under both systems (§4.3: "both systems
    achieve 100%") — which a scaling that leaves some prompts unservable even on an idle
    instance cannot reproduce;
  * mean prefill (the ratio of mean prefill times over the trace), 8K anchor and 128K anchor,
    reported as sensitivity. For each scaling the run reports the *feasible fraction* (prompts
    whose prefill alone fits the SLO) and hence the largest gain any scheduler could have at the
    knee (feasible fraction − FCFS attainment there).
- **Recorded arrivals** (a second arrival model, same lengths and SLO): Mooncake's own timestamps,
  each 3 s tick's requests spread uniformly over the tick (``Workload.spread_ticks``, one spread
  per seed), rescaled to the rate. The paper replays its production trace's arrivals; Mooncake's
  recorded arrivals are burstier than Poisson at the 10–60 s scale (index of dispersion 2–3), so
  this checks whether the Poisson redraw is what keeps the gain below the paper's.
- **The paper's own timing law** (a diagnostic, not the headline): the same sweep with prefill
  time following the paper's power law (:class:`PaperLawPrefill`, the paper's 8 s SLO, rates in its
  units) instead of Llama-3-8B/H100, to separate what the algorithm does from what the steeper
  length scaling of a dense 8B model does to it.
- 1 prefill + 1 decode instance (continuous batching decode); Kairos chunk C = 8192 tokens. The
  Kairos arms are the literal algorithm (``kairos-literal`` and its ablation presets), not the
  registered ``kairos`` (the do-no-harm version).
- Diagnostic arm ``kairos-costest``: Algorithm 2's FCFS walk with the cost model's prefill time
  instead of ``n / μ`` (not the paper; it measures what the constant-throughput estimate costs).
- Headline: ``ttft_attainment_gain_at_knee`` = Kairos (pseudo-code order) − FCFS TTFT attainment
  at the first swept rate where FCFS (mean over seeds) falls below 80%.

    python benchmarks/prefill_kairos.py

Predictors and context: this reproduction pins ``predictor="oracle"`` (the policies
read the cost model that charges the time, as before the honest-predictor default) and
``max_model_len=0`` (no context check: the paper setups run prompts longer than the spec's
context), so its figures stay comparable with the paper's and with earlier runs.
"""

from __future__ import annotations

import math
import time

import numpy as np

from laneserve.measure.simulate import run_point
from laneserve.bench.report import plot_curves
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.core.slo import SLO
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig
from laneserve.workloads import make_workload

N_REQUESTS = 800
SEEDS = (0, 1, 2, 3)
METRIC = "attainment_ttft"
PAPER_SLO, PAPER_8K, PAPER_128K = 8.0, 0.4004, 8.8
RATES = tuple(round(0.1 + 0.05 * k, 2) for k in range(19))        # 0.10 .. 1.00 req/s
SENSITIVITY_RATES = RATES[::2]
FCFS, KAIROS, KAIROS_ASC = "FCFS (DistServe)", "Kairos (pseudo-code, descending)", "Kairos ascending (ablation)"
KAIROS_COST = "Kairos, cost-model finish estimate (diagnostic)"
POLICIES = {FCFS: "fcfs", KAIROS: "kairos-literal", KAIROS_ASC: "kairos-asc", KAIROS_COST: "kairos-costest",
            "CP-EDF 2K": "cp-edf-2k", "CP-EDF 8K": "cp-edf-8k"}
SENSITIVITY_POLICIES = (FCFS, KAIROS, KAIROS_ASC)
HEADLINE = "equal reach (headline)"
MOONCAKE_TICK = 3.0                      # the trace's timestamp quantum (s)


def paper_prefill_time(n: np.ndarray | float) -> np.ndarray | float:
    """The paper's prefill time law through its two quoted points (§2.2)."""
    alpha = math.log(PAPER_128K / PAPER_8K) / math.log(16.0)
    return PAPER_8K * (np.asarray(n, dtype=float) / 8192.0) ** alpha


class PaperLawPrefill:
    """Prefill time from the paper's law: a chunk of ``n`` tokens on ``s`` cached costs
    ``T(s + n) − T(s)`` (the cumulative cost of a prompt is ``T``); steps add their chunks. Everything
    else (decode, transfer, capacity) is the wrapped cost model's."""

    def __init__(self, base) -> None:
        self.base = base
        self.name = "paper-law"
        self.attention, self.num_layers, self.kv_bytes_per_token = base.attention, base.num_layers, base.kv_bytes_per_token

    def __getattr__(self, item):
        return getattr(self.base, item)

    def prefill_time(self, batch) -> float:
        return float(sum(paper_prefill_time(s + n) - (paper_prefill_time(s) if s else 0.0) for n, s in batch))

    def prefill_op_times(self, batch) -> list[float]:
        ops = self.base.prefill_op_times(batch)
        scale = self.prefill_time(batch) / sum(ops)
        return [t * scale for t in ops]

    def graphed_prefill_time(self, batch) -> float:
        return self.prefill_time(batch)


def scaled_slos(cost, prompts: np.ndarray) -> dict[str, float]:
    alpha = math.log(PAPER_128K / PAPER_8K) / math.log(16.0)
    reach = 8192.0 * (PAPER_SLO / PAPER_8K) ** (1.0 / alpha)         # T_paper(reach) = 8 s
    paper_mean = float(np.mean(paper_prefill_time(prompts)))
    ours_mean = float(np.mean([cost.prefill_time([(int(n), 0)]) for n in prompts]))
    return {HEADLINE: cost.prefill_time([(int(reach), 0)]),
            "mean prefill": PAPER_SLO * ours_mean / paper_mean,
            "8K anchor": PAPER_SLO * cost.prefill_time([(8192, 0)]) / PAPER_8K,
            "128K anchor": PAPER_SLO * cost.prefill_time([(131072, 0)]) / PAPER_128K}


PAPER_LAW_RATES = tuple(round(0.2 + 0.1 * k, 1) for k in range(15))     # 0.2 .. 1.6 req/s


def sweep(base, slo: float, cost, policies, rates) -> list[dict]:
    """Attainment per (policy, rate), mean over the seeds, with each seed's value kept."""
    workloads = [base.with_arrivals("poisson", 1.0, seed=seed).with_slo(SLO(ttft=slo, tpot=0.05))
                 for seed in SEEDS]
    return sweep_workloads(workloads, policies, rates, cost)


def sweep_workloads(workloads, config_policies, rates, cost) -> list[dict]:
    """Like :func:`sweep` over prepared per-seed workloads (rescaled to each rate)."""
    rows = []
    for name in config_policies:
        config = ClusterConfig(predictor="oracle", max_model_len=0, prefill_policy=POLICIES[name])
        for rate in rates:
            per_seed = [run_point(wl, config, cost, rate=rate)[0] for wl in workloads]
            rows.append({"policy": name, "rate": rate,
                         METRIC: float(np.mean([s[METRIC] for s in per_seed])),
                         "per_seed": [round(s[METRIC], 4) for s in per_seed],
                         "median_ttft_ms": float(np.mean([s["median_ttft_ms"] for s in per_seed])),
                         "p90_ttft_ms": float(np.mean([s["p90_ttft_ms"] for s in per_seed]))})
        print(f"  {name:34s} " + " ".join(f"{r[METRIC]:.3f}" for r in rows if r["policy"] == name), flush=True)
    return rows


def knee(rows: list[dict], policy: str, seed_index: int | None = None) -> dict:
    def value(r):
        return r[METRIC] if seed_index is None else r["per_seed"][seed_index]
    fcfs = {r["rate"]: value(r) for r in rows if r["policy"] == FCFS}
    other = {r["rate"]: value(r) for r in rows if r["policy"] == policy}
    rate = next((x for x in sorted(fcfs) if fcfs[x] < 0.8), None)
    if rate is None:
        return {"rate": None, "gain": None}
    return {"rate": rate, "fcfs": fcfs[rate], "policy": other[rate], "gain": other[rate] - fcfs[rate]}


def recorded_section(rec_rows, rec_knee, rec_asc, slo) -> str:
    return (f"## Recorded arrivals (Mooncake timestamps, {MOONCAKE_TICK:g} s ticks spread, SLO {slo:.2f} s, "
            f"seeds {list(SEEDS)})\n\n"
            f"Knee: rate {rec_knee['rate']}, FCFS {rec_knee.get('fcfs')}, Kairos {rec_knee.get('policy')}, gain "
            f"{rec_knee['gain']}; ascending ablation gain {rec_asc['gain']}.\n\n"
            + markdown_table(rec_rows) + "\n")


def main() -> None:
    t0 = time.perf_counter()
    cost = make_cost_model("analytic", model="llama-3-8b", hardware="h100")
    base = make_workload("mooncake_conv").head(N_REQUESTS)
    prompts = np.array([s.prompt_len for s in base.specs])
    solo = np.array([cost.prefill_time([(int(n), 0)]) for n in prompts])
    slos = scaled_slos(cost, prompts)
    feasible = {k: float(np.mean(solo <= v)) for k, v in slos.items()}
    print("scaled TTFT SLOs:", {k: round(v, 2) for k, v in slos.items()}, "feasible:", feasible, flush=True)

    rows = sweep(base, slos[HEADLINE], cost, POLICIES, RATES)
    k_desc, k_asc, k_cost = knee(rows, KAIROS), knee(rows, KAIROS_ASC), knee(rows, KAIROS_COST)
    per_seed = [knee(rows, KAIROS, i) for i in range(len(SEEDS))]

    sensitivity = []
    for label in ("mean prefill", "8K anchor", "128K anchor"):
        print(f"sensitivity, SLO {label} = {slos[label]:.2f} s", flush=True)
        s_rows = sweep(base, slos[label], cost, SENSITIVITY_POLICIES, SENSITIVITY_RATES)
        for pol in SENSITIVITY_POLICIES[1:]:
            kn = knee(s_rows, pol)
            sensitivity.append({"slo": label, "ttft_slo_s": slos[label], "feasible_fraction": feasible[label],
                                "policy": pol, "knee_rate": kn["rate"], "fcfs_at_knee": kn.get("fcfs"),
                                "policy_at_knee": kn.get("policy"), "gain": kn["gain"],
                                "largest_possible_gain": (feasible[label] - kn["fcfs"]) if kn["rate"] else None})

    print("recorded arrivals (Mooncake timestamps, ticks spread)", flush=True)
    recorded = [base.spread_ticks(MOONCAKE_TICK, seed=seed).with_slo(SLO(ttft=slos[HEADLINE], tpot=0.05))
                for seed in SEEDS]
    rec_rows = sweep_workloads(recorded, SENSITIVITY_POLICIES, RATES, cost)
    rec_knee, rec_asc = knee(rec_rows, KAIROS), knee(rec_rows, KAIROS_ASC)
    rec_per_seed = [knee(rec_rows, KAIROS, i) for i in range(len(SEEDS))]

    print(f"paper's prefill law, SLO {PAPER_SLO} s", flush=True)
    law_rows = sweep(base, PAPER_SLO, PaperLawPrefill(cost), SENSITIVITY_POLICIES, PAPER_LAW_RATES)
    law_knee, law_asc = knee(law_rows, KAIROS), knee(law_rows, KAIROS_ASC)
    law_feasible = float(np.mean(paper_prefill_time(prompts) <= PAPER_SLO))

    by_rate = {(r["policy"], r["rate"]): r[METRIC] for r in rows}
    metrics = {
        "ttft_attainment_gain_at_knee": k_desc["gain"],
        "knee_rate": k_desc["rate"],
        "fcfs_attainment_at_knee": k_desc.get("fcfs"),
        "kairos_attainment_at_knee": k_desc.get("policy"),
        "gain_at_knee_per_seed": [round(k["gain"], 4) if k["gain"] is not None else None for k in per_seed],
        "ttft_attainment_gain_at_knee_ascending_ablation": k_asc["gain"],
        "ttft_attainment_gain_at_knee_cost_estimate_diagnostic": k_cost["gain"],
        "ttft_slo_s": slos[HEADLINE],
        "feasible_fraction": feasible[HEADLINE],
        "max_gain_over_fcfs": max(by_rate[(KAIROS, x)] - by_rate[(FCFS, x)] for x in RATES),
        "gain_at_knee_mean_prefill_slo": next(s["gain"] for s in sensitivity
                                              if s["slo"] == "mean prefill" and s["policy"] == KAIROS),
        "gain_at_knee_recorded_arrivals": rec_knee["gain"],
        "knee_rate_recorded_arrivals": rec_knee["rate"],
        "gain_at_knee_recorded_arrivals_per_seed": [round(k["gain"], 4) if k["gain"] is not None else None
                                                    for k in rec_per_seed],
        "gain_at_knee_recorded_arrivals_ascending_ablation": rec_asc["gain"],
        "gain_at_knee_paper_law": law_knee["gain"],
        "knee_rate_paper_law": law_knee["rate"],
        "kairos_attainment_at_knee_paper_law": law_knee.get("policy"),
        "gain_at_knee_paper_law_ascending_ablation": law_asc["gain"],
        "wall_seconds": time.perf_counter() - t0,
    }
    plot_curves(RESULTS_DIR / "prefill_kairos.png", rows, x_key="rate", y_keys=(METRIC,), group_key="policy",
                title=f"Mooncake lengths, Poisson ×{len(SEEDS)}, TTFT SLO {slos[HEADLINE]:.1f} s, Llama-3-8B / H100",
                target=0.8)
    md = ("Paper (§4.3): at QPS 3.0 FCFS 76.1% vs Kairos 100% TTFT attainment (+23.9%); at low QPS both 100%.\n\n"
          "Scaled TTFT SLOs (feasible fraction = prompts whose prefill alone fits): "
          + ", ".join(f"{k} {v:.2f} s ({feasible[k]:.3f})" for k, v in slos.items())
          + f"\n\n## TTFT attainment vs rate (SLO {slos[HEADLINE]:.2f} s, {N_REQUESTS} requests per point, "
            f"mean over Poisson seeds {list(SEEDS)})\n\n"
          + markdown_table([{k: v for k, v in r.items()} for r in rows])
          + "\n![attainment vs rate](prefill_kairos.png)\n\n"
          + recorded_section(rec_rows, rec_knee, rec_asc, slos[HEADLINE])
          + "## Sensitivity to the SLO scaling\n\n" + markdown_table(sensitivity)
          + f"\n\n## The paper's prefill-time law (T = 0.40 s · (n/8K)^1.11, SLO {PAPER_SLO} s, feasible fraction "
            f"{law_feasible:.3f})\n\nKnee: rate {law_knee['rate']}, FCFS {law_knee.get('fcfs')}, Kairos "
            f"{law_knee.get('policy')}, gain {law_knee['gain']}; ascending ablation gain {law_asc['gain']}.\n\n"
          + markdown_table(law_rows))
    write_result("prefill_kairos", metrics, markdown=md,
                 extra={"rows": rows, "sensitivity": sensitivity, "slos": slos, "feasible": feasible,
                        "recorded_arrival_rows": rec_rows,
                        "paper_law_rows": law_rows, "paper_law_feasible": law_feasible,
                        "n_requests": N_REQUESTS, "seeds": list(SEEDS),
                        "setup": "Llama-3-8B, H100 analytic cost model, 1 prefill + 1 decode (continuous), "
                                 "Mooncake conversation lengths (first N), Poisson arrivals, Kairos chunk 8192"})
    print(metrics)


if __name__ == "__main__":
    main()
