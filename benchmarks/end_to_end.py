"""Full stack on the Kairos setup: the best prefill + decode policies vs FCFS + continuous batching
(DistServe-like), on attainment of both SLOs (Kairos §4: +33.8 points end to end).

Setup (as benchmarks/decode_kairos.py, scaled from the paper's): the first 1000 requests of the
bundled Mooncake conversation trace (prompts median ~7K, p99 ~85K tokens), TTFT 8 s / TPOT 50 ms,
Llama-3.1-8B on the analytic H100 cost model with padded decode attention, NUM_PREFILL prefill +
NUM_DECODE decode instances, Poisson arrivals over a rate sweep. Headline: the largest gain in
attainment of both SLOs of the best combination over FCFS + continuous batching, over the rates
where the baseline still attains >= 20% (beyond that every policy is overloaded); every rate is in
the table and the plot. Target: metrics.e2e_attainment_gain >= 0.25.

    python benchmarks/end_to_end.py

Predictors: this reproduction pins ``predictor="oracle"`` (the policies read the cost
model that charges the time, as before the honest-predictor default), so its figures stay
comparable with the paper's and with earlier runs. Its ``kairos`` prefill is the literal algorithm
(``kairos-literal``; the registered ``kairos`` is the guarded version).
"""

from __future__ import annotations

from laneserve.measure.metrics import summarize
from laneserve.bench.report import plot_curves
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

NUM_PREFILL, NUM_DECODE, LIMIT = 2, 1, 1000
RATES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
BASELINE = "fcfs+continuous"
ARMS = (BASELINE, "cp-edf-2k+continuous", "fcfs+kairos", "kairos+continuous", "sedf+continuous",
        "kairos+kairos", "sedf+kairos")
PREFILL_SPECS = {"kairos": "kairos-literal"}    # the arms' "kairos" prefill is the paper's algorithm
DECODE_SPECS = {"kairos": "kairos:guard=false"}  # and its "kairos" decode is as reproduced before the guard


def run(workload, cost, arm: str, rate: float) -> dict:
    prefill, decode = arm.split("+")
    prefill, decode = PREFILL_SPECS.get(prefill, prefill), DECODE_SPECS.get(decode, decode)
    cfg = ClusterConfig(predictor="oracle", num_prefill=NUM_PREFILL, num_decode=NUM_DECODE, prefill_policy=prefill,
                        decode_policy=decode, router="least-loaded",
                        decode_opts={"cost_model": cost} if decode.startswith("kairos") else {})
    res = Simulator(cfg, cost).run(workload.with_rate(rate).specs)
    s = summarize(res.requests, duration=res.duration)
    return {"policy": arm, "rate": rate, "attainment_both": s["attainment_both"],
            "attainment_ttft": s["attainment_ttft"], "attainment_tpot": s["attainment_tpot"],
            "p90_ttft_ms": s["p90_ttft_ms"], "median_tpot_ms": s["median_tpot_ms"], "failed": s["failed"]}


def main() -> None:
    cost = make_cost_model(model="llama-3.1-8b", hardware="h100", attention="padded")
    wl = make_workload("mooncake_conv", limit=LIMIT)
    rows = []
    for arm in ARMS:
        for rate in RATES:
            rows.append(run(wl, cost, arm, rate))
            r = rows[-1]
            print(f"{arm:22s} {rate:4.2f} both {r['attainment_both']:.3f} ttft {r['attainment_ttft']:.3f} "
                  f"tpot {r['attainment_tpot']:.3f}", flush=True)
    base = {r["rate"]: r["attainment_both"] for r in rows if r["policy"] == BASELINE}
    eligible = [rate for rate in RATES if base[rate] >= 0.2]
    gains = {}
    for arm in ARMS[1:]:
        got = {r["rate"]: r["attainment_both"] for r in rows if r["policy"] == arm}
        gains[arm] = {rate: got[rate] - base[rate] for rate in eligible}
    if eligible:
        best_arm, best_rate = max(((a, r) for a in gains for r in gains[a]),
                                  key=lambda ar: gains[ar[0]][ar[1]])
        metrics = {"headline_selection": f"max over rates {eligible}",
                   "e2e_attainment_gain": gains[best_arm][best_rate],
                   "target_met": gains[best_arm][best_rate] >= 0.25,
                   "best_combination": best_arm, "at_rate": best_rate,
                   "baseline_attainment_at_rate": base[best_rate],
                   "mean_gain_over_eligible_rates": {a: sum(g.values()) / len(g) for a, g in gains.items()}}
    else:   # the baseline is below 20% at every rate: no rate qualifies, report it instead of crashing
        metrics = {"headline_selection": "not met: FCFS + continuous batching attains both SLOs "
                                         "for < 20% of requests at every rate",
                   "e2e_attainment_gain": None, "target_met": False}
    plot_curves(RESULTS_DIR / "end_to_end.png", rows, x_key="rate", y_keys=("attainment_both", "attainment_ttft",
                "attainment_tpot"), group_key="policy", title="Mooncake conversation, Llama-3.1-8B / H100 (padded)")
    write_result("end_to_end", metrics, markdown=markdown_table(rows) + "\n![curves](end_to_end.png)\n",
                 extra={"rows": rows, "cluster": f"{NUM_PREFILL}P+{NUM_DECODE}D", "requests": LIMIT})


if __name__ == "__main__":
    main()
