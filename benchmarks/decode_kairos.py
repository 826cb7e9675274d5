"""Kairos slack-guided decode vs continuous batching (Kairos §4.4-4.5; simulator).

Setup, scaled from the paper's (MiniMax-M2.5 on 4+4 H200, a 1000-request production long-tail
trace, TTFT SLO 8 s, TPOT SLO 50 ms): the first 1000 requests of the bundled Mooncake conversation
trace (prompts median ~7K, p99 ~85K, max ~126K tokens: the paper's 8K-vs-128K imbalance), its
TTFT 8 s / TPOT 50 ms SLOs, Llama-3.1-8B (128K context) on the analytic H100 cost model with
**padded** decode attention (a step pays ``batch * max(context)``: the straggler effect of §2.2).
4 FCFS prefill instances + 1 decode instance, so the decode instance is the one under load; both
arms share the prefill side and differ only in the decode policy. Poisson arrivals, swept rate.

Arms: ``continuous`` (vLLM FCFS continuous batching), ``kairos`` (Algorithm 3 with the default
``late_binds=False`` for padded kernels: requests already behind schedule do not bind s_min),
``kairos-literal`` (Algorithm 3 as printed: every request binds s_min). A ragged-attention run
(``sum(context)``; Kairos then keys its LUT by mean context and lets late requests bind) shows how
much of the effect is the kernel's. One paced run shows what the pacing buffer changes.

Headline (the paper's "up to" figures): the largest TPOT-attainment gain of ``kairos`` over
``continuous`` among the rates at which the baseline is not overloaded (its median TPOT within the
SLO); the per-request decode throughput gain (median over requests of ``(n-1)/(last-first)``
tokens/s) at that same rate. The mean and the all-rate maximum of the TPOT gain, and the smallest
throughput gain (lowest load), are reported beside them; every rate is in the table.

    python benchmarks/decode_kairos.py            # ~2-3 min, simulator only

Predictors: this reproduction pins ``predictor="oracle"`` (the policies read the cost
model that charges the time, as before the honest-predictor default), so its figures stay
comparable with the paper's and with earlier runs.
"""

from __future__ import annotations

import time

from laneserve.measure.metrics import summarize
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

MODEL, HARDWARE, TRACE, LIMIT = "llama-3.1-8b", "h100", "mooncake_conv", 1000
PADDED_RATES = (0.4, 0.5, 0.6, 0.7, 0.8)
RAGGED_RATES = (0.6, 1.0, 1.5)
PACED_RATE = 0.6
ARMS = ("continuous", "kairos", "kairos-literal")
#: the arms as reproduced before the do-no-harm guard: ``guard=false`` (``kairos-literal`` has it off)
SPECS = {"kairos": "kairos:guard=false", "kairos-paced": "kairos-paced:guard=false"}


def run(workload, cost, policy: str, rate: float, *, record: bool = False) -> dict:
    opts = {"cost_model": cost} if policy.startswith("kairos") else {}
    cfg = ClusterConfig(predictor="oracle", num_prefill=4, num_decode=1, prefill_policy="fcfs",
                        decode_policy=SPECS.get(policy, policy),
                        decode_opts=opts, record_token_times=record)
    sim = Simulator(cfg, cost)
    res = sim.run(workload.with_rate(rate).specs)
    s = summarize(res.requests, duration=res.duration)
    row = {"attention": cost.attention, "policy": policy, "rate": rate,
           "attainment_tpot": s["attainment_tpot"], "attainment_ttft": s["attainment_ttft"],
           "attainment_both": s["attainment_both"],
           "median_decode_tput": s["median_decode_throughput"],
           "mean_decode_tput": s["mean_decode_throughput"],
           "median_tpot_ms": s["median_tpot_ms"], "p90_tpot_ms": s["p90_tpot_ms"],
           "p99_itl_ms": s.get("p99_itl_ms"), "max_itl_ms": s["max_itl_ms"],
           "failed": s["failed"], "preemptions": res.instances[-1]["preemptions"]}
    stats = getattr(sim.back[0].scheduler, "stats", None)
    if hasattr(stats, "partial_steps"):                  # Kairos decode's own counters
        row["partial_step_share"] = stats.partial_steps / max(stats.steps, 1)
        row["fallback_step_share"] = stats.fallback_steps / max(stats.steps, 1)
    return row


def plot(rows: list[dict], path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    for (att, pol), style in {("padded", "continuous"): "k-o", ("padded", "kairos"): "C0-o",
                              ("padded", "kairos-literal"): "C1--o", ("ragged", "continuous"): "k:s",
                              ("ragged", "kairos"): "C0:s"}.items():
        pts = sorted((r["rate"], r) for r in rows
                     if r["attention"] == att and r["policy"] == pol and "paced" not in r)
        if not pts:
            continue
        rates = [p[0] for p in pts]
        ax1.plot(rates, [p[1]["attainment_tpot"] for p in pts], style, label=f"{pol} ({att})")
        ax2.plot(rates, [p[1]["median_decode_tput"] for p in pts], style, label=f"{pol} ({att})")
    ax1.set(xlabel="request rate (req/s)", ylabel="TPOT attainment (50 ms)", ylim=(0, 1.02))
    ax2.set(xlabel="request rate (req/s)", ylabel="median per-request decode tok/s")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Kairos decode vs continuous batching — {TRACE} ({LIMIT} req), {MODEL} / {HARDWARE}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gains(rows: list[dict], attention: str, policy: str) -> list[dict]:
    by = {(r["policy"], r["rate"]): r for r in rows if r["attention"] == attention and "paced" not in r}
    out = []
    for (pol, rate), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        if pol != policy:
            continue
        base = by[("continuous", rate)]
        out.append({"rate": rate,
                    "tpot_gain": r["attainment_tpot"] - base["attainment_tpot"],
                    "tput_gain": r["median_decode_tput"] / base["median_decode_tput"] - 1.0})
    return out


def main() -> None:
    t0 = time.perf_counter()
    workload = make_workload(TRACE, limit=LIMIT)
    rows = []
    padded = make_cost_model("analytic", model=MODEL, hardware=HARDWARE, attention="padded")
    for rate in PADDED_RATES:
        for arm in ARMS:
            rows.append(run(workload, padded, arm, rate))
    ragged = make_cost_model("analytic", model=MODEL, hardware=HARDWARE, attention="ragged")
    for rate in RAGGED_RATES:
        for arm in ARMS[:2]:
            rows.append(run(workload, ragged, arm, rate))
    paced = {**run(workload, padded, "kairos-paced", PACED_RATE, record=True), "paced": True}
    rows.append(paced)

    g = gains(rows, "padded", "kairos")
    # the paper's "up to" figures, over the rates at which the baseline is not overloaded
    # (continuous batching's median TPOT within the SLO); every rate is in the table
    loaded = {r["rate"] for r in rows if r["attention"] == "padded" and r["policy"] == "continuous"
              and r["median_tpot_ms"] <= 50.0}
    eligible = [x for x in g if x["rate"] in loaded]
    # no rate where the baseline meets its TPOT SLO: the headline is "not met", not a crash
    head = max(eligible, key=lambda x: x["tpot_gain"]) if eligible else None
    lit = {x["rate"]: x for x in gains(rows, "padded", "kairos-literal")}
    rg = gains(rows, "ragged", "kairos")
    unpaced = next(r for r in rows if r["attention"] == "padded" and r["policy"] == "kairos"
                   and r["rate"] == PACED_RATE)
    metrics = {
        "headline_selection": (f"max over rates {sorted(loaded)}" if head else
                               "not met: continuous batching's median TPOT exceeds the 50 ms SLO "
                               "at every rate, so no rate qualifies"),
        "tpot_attainment_gain": head["tpot_gain"] if head else None,
        "decode_throughput_gain": head["tput_gain"] if head else None,
        "headline_rate": head["rate"] if head else None,
        "baseline_not_overloaded_rates": sorted(loaded),
        "tpot_attainment_gain_mean": sum(x["tpot_gain"] for x in g) / len(g),
        "tpot_attainment_gain_max_all_rates": max(x["tpot_gain"] for x in g),
        "decode_throughput_gain_min": min(x["tput_gain"] for x in g),
        "literal_tpot_attainment_gain": lit[head["rate"]]["tpot_gain"] if head else None,
        "literal_decode_throughput_gain": lit[head["rate"]]["tput_gain"] if head else None,
        "literal_tpot_attainment_gain_max": max(x["tpot_gain"] for x in lit.values()),
        "ragged_tpot_attainment_gain_worst": min(x["tpot_gain"] for x in rg),
        "ragged_decode_throughput_gain_worst": min(x["tput_gain"] for x in rg),
        "paced_tpot_attainment_delta": paced["attainment_tpot"] - unpaced["attainment_tpot"],
        "paced_median_decode_tput": paced["median_decode_tput"],
        "unpaced_median_decode_tput": unpaced["median_decode_tput"],
        "paced_p99_itl_ms": paced["p99_itl_ms"],
        "attention_kernel": "padded (batch * max context)",
        "wall_seconds": time.perf_counter() - t0,
    }
    plot(rows, RESULTS_DIR / "decode_kairos.png")
    cols = ["attention", "policy", "rate", "attainment_tpot", "attainment_both", "median_decode_tput",
            "median_tpot_ms", "p90_tpot_ms", "max_itl_ms", "partial_step_share", "fallback_step_share",
            "preemptions", "failed"]
    md = (f"Simulator: first {LIMIT} requests of `{TRACE}` (TTFT 8 s, TPOT 50 ms), {MODEL} on the "
          f"analytic {HARDWARE} cost model, 4 FCFS prefill + 1 decode instance, Poisson arrivals. "
          "Decode attention: **padded** (a step pays batch x longest context) unless the row says "
          "ragged. `kairos` = Algorithm 3 with late requests not binding s_min (padded default); "
          "`kairos-literal` = Algorithm 3 as printed; `kairos-paced` = `kairos` with the pacing "
          "buffer (delivery times: TPOT attainment is invariant under pacing; per-request decode throughput is capped at 1/TPOT = 20 tok/s).\n\n"
          "Gains of `kairos` over `continuous` per rate (padded):\n\n"
          + markdown_table([{"rate": x["rate"], "tpot_attainment_gain": x["tpot_gain"],
                             "decode_throughput_gain": x["tput_gain"],
                             "literal_tpot_gain": lit[x["rate"]]["tpot_gain"],
                             "literal_tput_gain": lit[x["rate"]]["tput_gain"]} for x in g])
          + "\nAll runs:\n\n" + markdown_table(rows, cols) + "\n![curves](decode_kairos.png)\n")
    write_result("decode_kairos", metrics, markdown=md,
                 extra={"rows": rows, "setup": {"model": MODEL, "hardware": HARDWARE, "trace": TRACE,
                                                "limit": LIMIT, "num_prefill": 4, "num_decode": 1,
                                                "prefill_policy": "fcfs", "tpot_slo_s": 0.05,
                                                "ttft_slo_s": 8.0}})
    for k, v in metrics.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
