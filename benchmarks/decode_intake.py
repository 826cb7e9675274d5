"""Adaptive decode's intake rule against its ablations where decode KV memory is the bottleneck.

When a decode instance's KV memory is full, finished prefills wait as offered KV transfers, and
every second of that wait counts against their TPOT (``policies/decode/mechanisms/intake.py``). On the
league's ShareGPT workload that wait, not prefill, bounds every policy's goodput. This benchmark
runs the league's ShareGPT cells (same workload builder, cost model, host pool, run lengths and
2% bisection: ``benchmarks/league.py``; online predictors) for:

- ``fcfs+continuous``, the best baseline there;
- ``adaptive+adaptive:intake=oldest``: oldest offer first (vLLM's order, every other policy's);
- ``adaptive+adaptive``: the default ``slack`` intake (oldest first while the oldest offer could
  still meet the TPOT of the shortest tenth of recent outputs, newest first past that);
- ``adaptive+adaptive:intake=newest``: always newest first (bounded by ``max_offer_wait``).

It reports each one's goodput and, on a grid of rates around the baselines' goodput (4P+4D), the
attainment, P99 TPOT and the P99 and longest wait of an offer (prefill end to transfer start):
what the intake trades for the goodput.

    PYTHONPATH=. python benchmarks/decode_intake.py --jobs 2
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.league import (DURATION, HARDWARE, HOST_KV_TOKENS, MAX_EVALS, MAX_SIZES, MODEL,  # noqa: E402
                               REL_TOL, SIZES, WORKLOADS)
from laneserve.measure.simulate import run_point  # noqa: E402
from laneserve.bench.league import Entry, entry_config, run_league  # noqa: E402
from laneserve.measure.parallel import default_jobs, map_jobs  # noqa: E402
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from laneserve.costmodel import make_cost_model  # noqa: E402

ENTRIES = [Entry("fcfs", "continuous", "baseline"),
           Entry("adaptive", "adaptive:intake=oldest", "adaptive"),
           Entry("adaptive", "adaptive", "adaptive"),
           Entry("adaptive", "adaptive:intake=newest", "adaptive")]
GRID = (100.0, 110.0, 115.0, 120.0, 125.0, 130.0, 140.0)     # req/s, ShareGPT 4P+4D
GRID_SHAPE = "4P+4D"


def grid_point(workload, config, cost, rate: float) -> dict:
    """One rate of the grid: attainment, P99 TPOT and the offers' waits (module level: workers)."""
    n = min(max(SIZES[GRID_SHAPE], math.ceil(rate * DURATION)), len(workload))
    summary, res = run_point(workload.head(n), config, cost, rate=rate)
    waits = np.array([r.times.transfer_start - r.times.prefill_end for r in res.requests
                      if r.times.transfer_start is not None and r.times.prefill_end is not None])
    return {"rate": rate, "requests": n, "attainment": summary["attainment_both"],
            "attainment_tpot": summary["attainment_tpot"], "p99_tpot_ms": summary["p99_tpot_ms"],
            "p99_offer_wait_s": float(np.percentile(waits, 99)), "max_offer_wait_s": float(waits.max())}


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for entry in ENTRIES:
        pts = [r for r in rows if r["entry"] == entry.name]
        left.plot([r["rate"] for r in pts], [r["attainment"] for r in pts], marker="o", label=entry.name)
        right.plot([r["rate"] for r in pts], [r["max_offer_wait_s"] for r in pts], marker="o", label=entry.name)
    left.axhline(0.9, color="grey", lw=0.8, ls="--")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("share meeting TTFT and TPOT")
    left.set_title(f"ShareGPT {GRID_SHAPE}: attainment")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("longest wait for decode memory (s)")
    right.set_title("what newest-first costs: the longest offer wait")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=default_jobs(), help="worker processes")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cost = make_cost_model("analytic", model=MODEL, hardware=HARDWARE)
    sharegpt = [w for w in WORKLOADS if w.name == "sharegpt"]
    league = run_league(sharegpt, ENTRIES, cost, sizes=SIZES, modes=("online",), jobs=args.jobs,
                        rel_tol=REL_TOL, max_evals=MAX_EVALS, host_kv_tokens=HOST_KV_TOKENS,
                        duration=DURATION, max_sizes=MAX_SIZES,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    goodput = {(c.shape, c.entry): c.goodput for c in league["cells"]}
    shapes = sorted({c.shape for c in league["cells"]})
    base = {s: goodput[(s, "fcfs+continuous")] for s in shapes}
    good_rows = [{"entry": e.name, **{f"goodput_{s}": goodput[(s, e.name)] for s in shapes},
                  **{f"vs_fcfs_{s}": goodput[(s, e.name)] / base[s] for s in shapes}} for e in ENTRIES]

    wl = sharegpt[0].build(MAX_SIZES[GRID_SHAPE], cost)
    tasks = [(wl, entry_config(e, GRID_SHAPE, sharegpt[0], "online", host_kv_tokens=HOST_KV_TOKENS), cost, r)
             for e in ENTRIES for r in GRID]
    points = map_jobs(grid_point, tasks, args.jobs)
    grid_rows = [{"entry": e.name, **p} for (e, _), p in zip(((e, r) for e in ENTRIES for r in GRID), points)]
    for row in grid_rows:
        print(f"{row['entry']:34s} {row['rate']:6.1f} req/s attainment {row['attainment']:.3f} "
              f"p99 TPOT {row['p99_tpot_ms']:7.1f} ms max offer wait {row['max_offer_wait_s']:5.1f} s", file=sys.stderr)

    def ratio(entry: str, shape: str) -> float:
        return goodput[(shape, entry)] / base[shape]
    metrics = {f"adaptive_vs_fcfs_{s}": ratio("adaptive+adaptive", s) for s in shapes}
    metrics.update({f"oldest_vs_fcfs_{s}": ratio("adaptive+adaptive:intake=oldest", s) for s in shapes})
    metrics.update({f"newest_vs_fcfs_{s}": ratio("adaptive+adaptive:intake=newest", s) for s in shapes})
    metrics["wall_seconds"] = time.perf_counter() - t0
    plot(grid_rows, RESULTS_DIR / "decode_intake.png")
    md = ("Goodput (req/s; highest rate with >= 90% meeting TTFT 0.4 s and TPOT 50 ms, league bisection, "
          "online predictors) and its ratio to fcfs+continuous's:\n\n" + markdown_table(good_rows)
          + f"\nShareGPT {GRID_SHAPE} on a grid of rates: attainment, P99 TPOT, and the P99 and longest wait "
            "of a finished prefill for decode memory (prefill end to KV transfer start):\n\n"
          + markdown_table(grid_rows) + "\n![intake](decode_intake.png)\n")
    write_result("decode_intake", metrics, markdown=md, extra={"goodput": good_rows, "grid": grid_rows,
                                                               "points": {f"{c.shape} {c.entry}": c.points
                                                                          for c in league["cells"]}})
    print({k: round(v, 3) for k, v in metrics.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
