"""Head-of-line blocking under FCFS prefill (the shape of LAPS Figure 3).

Short prompts (32–256 tokens) mixed with long ones (4K–8K) at a fixed request rate on one prefill
+ one decode instance (Llama-3-8B, H100 analytic cost model). As the share of long prompts grows,
short requests queue behind long prefills and their P90 TTFT rises far faster than their own
work does; chunked-prefill EDF is shown beside FCFS.

    python benchmarks/hol_effect.py
"""

from __future__ import annotations

from pathlib import Path

from laneserve.measure.metrics import summarize
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import make_workload

LONG_SHARES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3)
RATE = 10.0
POLICIES = {"fcfs": ClusterConfig(), "cp-edf-2k": ClusterConfig(prefill_policy="cp-edf-2k")}


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for policy in POLICIES:
        pts = [(r["long_share"], r["short_p90_ttft_ms"]) for r in rows if r["policy"] == policy]
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=policy)
    ax.set_xlabel("long requests (% of all)")
    ax.set_ylabel("short-request P90 TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Head-of-line blocking, {RATE:g} req/s, Llama-3-8B / H100")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    cost = make_cost_model(model="llama-3-8b", hardware="h100")
    rows = []
    for share in LONG_SHARES:
        wl = make_workload("short_long_mix", n=4000, long_share=share, rate=RATE, seed=0)
        for policy, config in POLICIES.items():
            res = Simulator(config, cost).run(wl.specs)
            short = [r for r in res.requests if r.slo_class == "short"]
            s = summarize(short, duration=res.duration)
            util = res.instances[0]["utilization"]
            rows.append({"policy": policy, "long_share": share, "short_p50_ttft_ms": s["median_ttft_ms"],
                         "short_p90_ttft_ms": s["p90_ttft_ms"], "short_p99_ttft_ms": s["p99_ttft_ms"],
                         "prefill_utilization": util})
            print(f"{policy:10s} long={share:4.2f} short P90 TTFT {s['p90_ttft_ms']:8.1f} ms "
                  f"(prefill util {util:.2f})", flush=True)
    fcfs = [r["short_p90_ttft_ms"] for r in rows if r["policy"] == "fcfs"]
    metrics = {"fcfs_short_p90_ttft_ms_by_long_share": dict(zip(map(str, LONG_SHARES), fcfs)),
               "fcfs_p90_growth_0_to_30pct": fcfs[-1] / fcfs[0],
               "fcfs_monotone": all(a < b for a, b in zip(fcfs, fcfs[1:]))}
    plot(rows, RESULTS_DIR / "hol_effect.png")
    write_result("hol_effect", metrics, extra={"rows": rows, "rate": RATE},
                 markdown=markdown_table(rows) + "\n![curve](hol_effect.png)\n")


if __name__ == "__main__":
    main()
