"""The league's ratios with one entry's cells taken from a partial re-run.

When a change moves only one entry (adaptive) on a few cells, re-running those cells (with the
baselines, as ``league.py --entries`` does) and recomputing every ratio against the committed
``league.json``'s other cells gives the league's figures for that entry without the full run (~1
hour at ``--jobs 2``). The searches are per cell, so the other entries' cells are unchanged; the
area ratios use the same shared log-rate span as the league.

    python benchmarks/league.py --workloads mooncake_conv,kairos,longctx --entries adaptive+adaptive \\
        -j 1 --output /tmp/rerun
    python benchmarks/league_rerun.py /tmp/rerun/league.json --name league_gate_cells
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import league  # noqa: E402  (benchmarks/league.py: the league's entries)

from laneserve.bench.league import Cell, cell_ratios  # noqa: E402
from laneserve.bench.results import RESULTS_DIR, markdown_table, write_result  # noqa: E402


def cells_of(data: dict) -> dict[tuple, Cell]:
    """A league.json's cells, keyed (workload, shape, entry, mode), with their search points."""
    out = {}
    for c in data["cells"]:
        key = f"{c['workload']} {c['shape']} {c['entry']} {c['mode']}"
        out[(c["workload"], c["shape"], c["entry"], c["mode"])] = Cell(
            workload=c["workload"], shape=c["shape"], entry=c["entry"], kind=c["kind"], mode=c["mode"],
            goodput=c["goodput"], evals=c["evals"], saturated=c["saturated"], monotone=c["monotone"],
            points=[tuple(p) for p in data["points"][key]], wall_s=0.0, max_requests=c.get("max_requests", 0))
    return out


def merged_rows(old: dict, new: dict, entry: str) -> list[dict]:
    """``entry``'s rows on the re-run cells: before (the committed league) and after."""
    before = {(r["workload"], r["shape"], r["mode"]): r for r in old["cells"] if r["entry"] == entry}
    cells = cells_of(old)
    rerun = {k: c for k, c in cells_of(new).items() if c.entry == entry}
    cells.update(rerun)
    keys = {(w, s, m) for (w, s, _, m) in rerun}
    rows = []
    for r in cell_ratios(cells.values(), league.ENTRIES):
        k = (r["workload"], r["shape"], r["mode"])
        if r["entry"] != entry or k not in keys:
            continue
        b = before[k]
        rows.append({"workload": k[0], "shape": k[1], "mode": k[2],
                     "goodput_before": b["goodput"], "goodput": r["goodput"],
                     "vs_best_baseline_before": b["ratio_vs_best_baseline"], "vs_best_baseline": r["ratio_vs_best_baseline"],
                     "vs_best_policy_before": b["ratio_vs_best_other"], "vs_best_policy": r["ratio_vs_best_other"],
                     "area_vs_best_baseline_before": b["area_ratio_vs_best_baseline"],
                     "area_vs_best_baseline": r["area_ratio_vs_best_baseline"],
                     "area_vs_best_policy_before": b["area_ratio_vs_best_other"],
                     "area_vs_best_policy": r["area_ratio_vs_best_other"], "plateau": r["plateau"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rerun", type=Path, help="league.json of the partial re-run")
    ap.add_argument("--league", type=Path, default=RESULTS_DIR / "league.json")
    ap.add_argument("--entry", default="adaptive+adaptive")
    ap.add_argument("--name", default="league_rerun")
    args = ap.parse_args()
    rows = merged_rows(json.loads(args.league.read_text()), json.loads(args.rerun.read_text()), args.entry)
    if not rows:
        raise SystemExit(f"no {args.entry} cells in {args.rerun}")
    metrics = {f"min_{k}": min((r[k] for r in rows if r[k] is not None), default=None)
               for k in ("vs_best_baseline", "vs_best_policy", "area_vs_best_baseline", "area_vs_best_policy")}
    metrics["min_vs_best_policy_outside_plateaus"] = min(
        (r["vs_best_policy"] for r in rows if not r["plateau"] and r["vs_best_policy"] is not None), default=None)
    md = (f"{args.entry}'s cells re-run ({args.rerun}), every other entry's cells from {args.league.name}; "
          "ratios recomputed as the league does.\n\n" + markdown_table(rows))
    write_result(args.name, metrics, markdown=md, extra={"rows": rows})


if __name__ == "__main__":
    main()
