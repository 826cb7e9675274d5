"""The policy league's plumbing (tiny sizes) and the demo's summary line."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest

from laneserve.bench.demo import BASELINE, DEFAULT, PAPER_POLICIES, demo_policies, registered, summary_line
from laneserve.bench.league import (SHAPES, Cell, Entry, LeagueWorkload, cell_ratios, idle_multiple_slo,
                                    idle_prefill_time, league_metrics, missing_policy, plot_heatmap,
                                    RunLength, predictor_modes, run_league, search_cell)
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig
from laneserve.workloads import make_workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cost():
    return make_cost_model("analytic", model="llama-3.1-8b", hardware="h100")


def _short_long(n, cost):
    return make_workload("short_long_mix", n=n, long_share=0.2, output_len=(2, 8), seed=1)


TINY_ENTRIES = [
    Entry("fcfs", "continuous", "baseline"),
    Entry("cp-edf-2k", "continuous", "baseline"),
    Entry("sedf", "continuous", "paper", paper="FlowPrefill"),
    Entry("fcfs", "continuous", "router", router="round-robin", shapes=("4P+4D",), reference="fcfs+continuous"),
    Entry("no-such-policy", "continuous", "adaptive"),
]


def test_tiny_league_runs_every_cell_and_reduces_them(cost, tmp_path):
    workloads = [LeagueWorkload("short_long", "per class", _short_long)]
    lines = []
    league = run_league(workloads, TINY_ENTRIES, cost, sizes={"1P+1D": 30, "4P+4D": 40}, max_evals=2,
                        rel_tol=0.3, jobs=1, host_kv_tokens=0, progress=lines.append)
    modes = league["modes"]
    assert league["skipped"] == {"no-such-policy+continuous": "prefill policy 'no-such-policy' is not registered"}
    cells = league["cells"]
    # 1P+1D: 3 runnable entries; 4P+4D: those plus the router entry
    assert len(cells) == len(workloads) * (3 + 4) * len(modes)
    assert len(lines) == len(cells) and lines[-1].startswith(f"[{len(cells)}/{len(cells)}]")
    for c in cells:
        assert 1 <= c.evals == len(c.points)
        ok = [x for x, a in c.points if a >= 0.9]
        assert c.goodput == (max(ok) if ok else None)      # the answer is an evaluated, passing rate

    rows = cell_ratios(cells, TINY_ENTRIES)
    for key in {(r["workload"], r["shape"], r["mode"]) for r in rows}:
        base = [r for r in rows if (r["workload"], r["shape"], r["mode"]) == key and r["kind"] == "baseline"]
        best = max(r["goodput"] or 0.0 for r in base)
        if best > 0:
            assert max(r["ratio_vs_best_baseline"] for r in base) == pytest.approx(1.0)
    metrics, detail = league_metrics(rows)
    paper = [r["ratio_vs_best_baseline"] for r in rows if r["kind"] == "paper"
             and r["ratio_vs_best_baseline"] is not None]
    assert metrics["worst_paper_policy_ratio_vs_best_baseline"] == pytest.approx(min(paper))
    routers = [r for r in rows if r["kind"] == "router"]
    assert all(r["reference"] == "fcfs+continuous" and r["shape"] == "4P+4D" for r in routers)
    assert metrics["adaptive_min_ratio_vs_best_baseline"] is None      # skipped: no cell
    assert detail["worst_paper_policy_ratio_vs_best_baseline"]["where"].startswith("sedf+continuous on ")

    png = tmp_path / "league.png"
    plot_heatmap(png, rows, shapes=list(SHAPES), mode=modes[0])
    assert png.stat().st_size > 1000


def test_a_run_covers_the_duration_at_each_rate():
    length = RunLength(200, duration=30.0)
    assert length.requests(1.0, 10_000) == 200           # the floor
    assert length.requests(100.0, 10_000) == 3000        # 30 s of arrivals at 100 req/s
    assert length.requests(1000.0, 10_000) == 10_000     # at most what the workload holds
    assert RunLength(200).requests(1000.0, 10_000) == 200


def test_a_search_simulates_more_requests_at_higher_rates(cost):
    wl = _short_long(400, cost)
    cfg = ClusterConfig(prefill_policy="fcfs", decode_policy="continuous")
    fixed = search_cell(wl, cfg, cost, 1.0, 64.0, 0.3, 6, RunLength(40))
    timed = search_cell(wl, cfg, cost, 1.0, 64.0, 0.3, 6, RunLength(40, duration=10.0))
    assert fixed["max_requests"] == 40
    top = max(x for x, _ in timed["points"])
    assert timed["max_requests"] == min(400, max(40, math.ceil(top * 10.0))) > 40


def _cell(workload, entry, kind, goodput, shape="1P+1D"):
    return Cell(workload=workload, shape=shape, entry=entry, kind=kind, mode="default", goodput=goodput,
                evals=1, saturated=False, monotone=True, points=[], wall_s=0.0)


def test_league_metrics_are_minima_with_their_place():
    entries = [Entry("fcfs", "continuous", "baseline"), Entry("cp-edf-2k", "continuous", "baseline"),
               Entry("sedf", "continuous", "paper"), Entry("fcfs", "alignedserve", "paper"),
               Entry("fcfs", "continuous", "router", router="rr", reference="fcfs+continuous"),
               Entry("adaptive", "adaptive", "adaptive")]
    cells = [
        _cell("a", "fcfs+continuous", "baseline", 10.0), _cell("a", "cp-edf-2k+continuous", "baseline", 8.0),
        _cell("a", "sedf+continuous", "paper", 20.0), _cell("a", "fcfs+alignedserve", "paper", None),
        _cell("a", "fcfs+continuous@rr", "router", 7.0), _cell("a", "adaptive+adaptive", "adaptive", 19.0),
        _cell("b", "fcfs+continuous", "baseline", 4.0), _cell("b", "cp-edf-2k+continuous", "baseline", 5.0),
        _cell("b", "sedf+continuous", "paper", 5.0), _cell("b", "fcfs+alignedserve", "paper", 4.5),
        _cell("b", "fcfs+continuous@rr", "router", 4.0), _cell("b", "adaptive+adaptive", "adaptive", 5.5),
    ]
    metrics, detail = league_metrics(cell_ratios(cells, entries))
    assert metrics["worst_paper_policy_ratio_vs_best_baseline"] == 0.0          # never met counts as 0
    assert detail["worst_paper_policy_ratio_vs_best_baseline"]["where"] == "fcfs+alignedserve on a 1P+1D"
    assert metrics["adaptive_min_ratio_vs_best_baseline"] == pytest.approx(1.1)  # 5.5 / 5 on b
    assert metrics["adaptive_min_ratio_vs_best_policy"] == pytest.approx(19 / 20)
    assert metrics["worst_router_ratio_vs_least_loaded"] == pytest.approx(0.7)   # 7 / 10 on a


def test_undefined_ratio_is_left_out_and_listed():
    entries = [Entry("fcfs", "continuous", "baseline"), Entry("sedf", "continuous", "paper")]
    cells = [_cell("a", "fcfs+continuous", "baseline", None), _cell("a", "sedf+continuous", "paper", 3.0),
             _cell("b", "fcfs+continuous", "baseline", 2.0), _cell("b", "sedf+continuous", "paper", 3.0)]
    metrics, detail = league_metrics(cell_ratios(cells, entries))
    assert metrics["worst_paper_policy_ratio_vs_best_baseline"] == pytest.approx(1.5)
    assert detail["worst_paper_policy_ratio_vs_best_baseline"]["undefined"] == ["a 1P+1D sedf+continuous"]


def test_idle_multiple_slo_rule(cost):
    wl = make_workload("short_long_mix", n=20, long_share=0.5, long_len=16384, seed=0)
    ruled = idle_multiple_slo(wl, cost, multiple=3.0, floor=0.4, tpot=0.05)
    for s in ruled.specs:
        assert s.slo.ttft == pytest.approx(max(0.4, 3.0 * idle_prefill_time(s, cost)))
        assert s.slo.tpot == 0.05
    assert {s.slo.ttft == 0.4 for s in ruled.specs} == {True, False}   # short ones floored, long ones not
    # a prefix counts only when prefix caching is on: without it the whole prompt is prefilled
    long = replace(max(wl.specs, key=lambda s: s.prompt_len), prefix_len=16000)
    assert idle_prefill_time(long, cost) > 10 * idle_prefill_time(long, cost, cached=True)


def test_predictor_axis_follows_the_sim_config():
    has = "predictor" in {f.name for f in fields(ClusterConfig)}
    assert predictor_modes() == (("online", "oracle") if has else ("default",))


def test_missing_policy_names_the_unregistered_part():
    assert missing_policy(Entry("fcfs", "continuous", "baseline")) is None
    assert "router policy 'nowhere'" in missing_policy(Entry("fcfs", "continuous", "router", router="nowhere"))
    assert "decode policy 'nope'" in missing_policy(Entry("fcfs", "nope:x=1", "paper"))


def test_benchmark_workloads_build_with_their_slo_rules(cost):
    spec = importlib.util.spec_from_file_location("league_bench", ROOT / "benchmarks" / "league.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert len(bench.WORKLOADS) >= 8 and len({w.name for w in bench.WORKLOADS}) == len(bench.WORKLOADS)
    for lw in bench.WORKLOADS:
        wl = lw.build(30, cost)
        assert len(wl) == 30 and lw.slo_rule
        assert all(s.slo.ttft and s.slo.tpot and math.isfinite(s.slo.ttft) for s in wl.specs), lw.name
    multi = next(w for w in bench.WORKLOADS if w.name == "multislo").build(200, cost)
    assert {s.slo_class for s in multi.specs} == set(bench.MULTI_SLO)
    kinds = {e.kind for e in bench.ENTRIES}
    assert {"baseline", "paper", "composition", "router", "adaptive"} <= kinds
    assert any(e.name == "adaptive+adaptive" for e in bench.ENTRIES)


def test_benchmark_workload_seeds_draw_fresh_samples_and_seed_0_is_the_league(cost):
    spec = importlib.util.spec_from_file_location("league_bench", ROOT / "benchmarks" / "league.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.seeded(bench.WORKLOADS, 0) is bench.WORKLOADS
    for lw0, lw1 in zip(bench.WORKLOADS, bench.seeded(bench.WORKLOADS, 1)):
        a, b = lw0.build(40, cost), lw1.build(40, cost)
        assert len(a) == len(b) == 40, lw0.name
        assert [(s.arrival_time, s.prompt_len) for s in a.specs] != [(s.arrival_time, s.prompt_len)
                                                                   for s in b.specs], lw0.name
        assert {s.slo for s in b.specs} and all(math.isfinite(s.slo.ttft) for s in b.specs), lw0.name
    with pytest.raises(SystemExit):
        bench.trace_block("azure_conv", 40, 3)


@pytest.mark.parametrize("argv,why", [(["--tail-evals", "-1"], "--tail-evals must be at least 0"),
                                      (["--curve-evals", "-2"], "--curve-evals must be at least 0"),
                                      (["--jobs", "0"], "--jobs must be at least 1")])
def test_benchmark_refuses_negative_counts_before_running(argv, why, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("league_bench", ROOT / "benchmarks" / "league.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "run_league", lambda *a, **k: pytest.fail("ran with a bad count"))
    monkeypatch.setattr("sys.argv", ["league.py", *argv])
    with pytest.raises(SystemExit) as refused:
        bench.main()
    assert refused.value.code == 2 and why in capsys.readouterr().err


# ---- the demo ----------------------------------------------------------------------------------
def test_summary_line_with_the_default():
    line = summary_line({BASELINE: 10.0, "sedf+continuous": 30.0, DEFAULT: 25.0})
    assert line == (f"The default, {DEFAULT}, gets 2.50x the goodput of {BASELINE} "
                    f"(25.00 vs 10.00 req/s, +150%).")


def test_summary_line_without_the_default_names_the_best_policy():
    line = summary_line({BASELINE: 10.0, "sedf+continuous": 30.0, "fcfs+alignedserve": None})
    assert line.startswith(f"{DEFAULT} is not registered; the best policy here, sedf+continuous, gets 3.00x")


def test_summary_line_when_the_baseline_never_meets_the_target():
    line = summary_line({BASELINE: None, DEFAULT: 4.0})
    assert "4.00 req/s" in line and "never meets" in line


def test_demo_policies():
    got = demo_policies()
    assert got[0] == BASELINE and list(PAPER_POLICIES) == got[1:1 + len(PAPER_POLICIES)]
    assert (DEFAULT in got) == registered(DEFAULT)


def test_a_paper_group_is_judged_by_its_best_pairing_and_baseline_routers_are_not_held():
    entries = [Entry("fcfs", "continuous", "baseline"), Entry("cp-edf-2k", "continuous", "baseline"),
               Entry("fcfs", "alignedserve", "paper", paper="AlignedServe"),
               Entry("cp-edf-2k", "alignedserve", "paper", paper="AlignedServe"),
               Entry("laps", "continuous", "paper", paper="LAPS"),
               Entry("fcfs", "continuous", "baseline-router", router="rr", reference="fcfs+continuous")]
    cells = [_cell("a", "fcfs+continuous", "baseline", 2.0), _cell("a", "cp-edf-2k+continuous", "baseline", 10.0),
             _cell("a", "fcfs+alignedserve", "paper", 2.0), _cell("a", "cp-edf-2k+alignedserve", "paper", 9.8),
             _cell("a", "laps+continuous", "paper", 9.0),
             _cell("a", "fcfs+continuous@rr", "baseline-router", 1.0)]
    rows = cell_ratios(cells, entries)
    aligned = [r for r in rows if r["entry"].endswith("alignedserve")]
    assert {r["paper_group_best"] for r in aligned} == {"cp-edf-2k+alignedserve"}
    assert [r["paper_ratio_vs_best_baseline"] for r in aligned] == [pytest.approx(0.98)] * 2
    assert next(r for r in aligned if r["entry"] == "fcfs+alignedserve")["ratio_vs_best_baseline"] == 0.2
    metrics, detail = league_metrics(rows)
    assert metrics["worst_paper_policy_ratio_vs_best_baseline"] == pytest.approx(0.9)     # LAPS alone
    assert detail["worst_paper_policy_ratio_vs_best_baseline"]["where"] == "laps+continuous on a 1P+1D"
    assert metrics["worst_router_ratio_vs_least_loaded"] is None                          # rr is not held
