"""The league's goodput figures that say how sure they are: the area goodput, the plateau marks,
and the attainment curve a search follows for them."""

from __future__ import annotations

import math

import pytest

from laneserve.bench.league import (Cell, Entry, area_goodput, cell_ratios, curve_rates, league_metrics,
                                    plateau, search_cell)
from laneserve.costmodel import make_cost_model
from laneserve.sim import ClusterConfig
from laneserve.workloads import make_workload


def _cell(entry, kind, goodput, points):
    return Cell(workload="w", shape="1P+1D", entry=entry, kind=kind, mode="online", goodput=goodput,
                evals=len(points), saturated=False, monotone=True, points=points, wall_s=0.0)


def step_curve(crossing: float, rates: list[float]) -> list[tuple[float, float]]:
    return [(r, 1.0 if r <= crossing else 0.0) for r in rates]


def test_area_goodput_of_a_steep_curve_is_near_its_crossing():
    rates = [2.0 ** (k / 8) for k in range(0, 64)]
    points = step_curve(10.0, rates)
    got = area_goodput(points, 1.0, rates[-1])
    assert got == pytest.approx(10.0, rel=0.1)
    assert area_goodput([(1.0, 1.0), (100.0, 1.0)], 1.0, 100.0) == pytest.approx(100.0)
    assert area_goodput([], 1.0, 2.0) is None


def test_a_plateau_moves_the_crossing_far_but_the_area_little():
    """Two curves on one plateau (0.88-0.92 over 1-4 req/s): one crosses 90% at 1 req/s, the
    other at 4; the crossing ratio is 4, the area ratio close to 1."""
    rates = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
    low = [(r, 0.99 if r < 1 else (0.9 if r == 1 else (0.89 if r <= 4 else 0.3))) for r in rates]
    high = [(r, 0.99 if r < 1 else (0.91 if r <= 4 else 0.3)) for r in rates]
    assert plateau(low) == (1.0, 4.0) and plateau(high) == (1.0, 4.0)
    a_low, a_high = area_goodput(low, 0.25, 8.0), area_goodput(high, 0.25, 8.0)
    assert 1.0 <= a_high / a_low < 1.1
    cells = [_cell("fcfs+continuous", "baseline", 1.0, low), _cell("adaptive+adaptive", "adaptive", 4.0, high)]
    rows = cell_ratios(cells, [Entry("fcfs", "continuous", "baseline"), Entry("adaptive", "adaptive", "adaptive")])
    adaptive = next(r for r in rows if r["kind"] == "adaptive")
    assert adaptive["ratio_vs_best_baseline"] == pytest.approx(4.0)
    assert adaptive["area_ratio_vs_best_baseline"] == pytest.approx(a_high / a_low)
    assert adaptive["plateau"] and adaptive["plateau_ratio"]
    metrics, detail = league_metrics(rows)
    assert metrics["adaptive_min_area_ratio_vs_best_baseline"] == pytest.approx(a_high / a_low)
    assert metrics["plateau_cells"] == 2


def test_no_plateau_on_a_steep_curve():
    assert plateau([(1.0, 0.99), (2.0, 0.9), (2.1, 0.88), (4.0, 0.2)]) is None


def test_curve_rates_are_half_octaves():
    assert curve_rates(1.0, 4.0) == pytest.approx([1.0, math.sqrt(2), 2.0, 2 * math.sqrt(2), 4.0])


def _small_search(**more):
    """One FCFS goodput search on a small short/long mix over [0.5, 64] req/s."""
    cost = make_cost_model("analytic", model="llama-3.1-8b", hardware="h100")
    wl = make_workload("short_long_mix", n=60, long_share=0.2, seed=0)
    cfg = ClusterConfig(prefill_policy="fcfs", decode_policy="continuous")
    return search_cell(wl, cfg, cost, 0.5, 64.0, 0.3, 6, **more)


def test_a_search_follows_the_curve_down_to_the_floor():
    plain = _small_search()
    curved = _small_search(curve_evals=4)
    assert curved["goodput"] == plain["goodput"]                 # the crossing is the same search
    extra = [p for p in curved["points"] if p not in plain["points"]]
    assert 0 < len(extra) <= 4
    grid = curve_rates(0.5, 64.0)
    assert all(any(abs(x - g) <= 1e-9 * g for g in grid) for x, _ in extra)


def test_a_search_tail_follows_the_grid_above_its_highest_rate_down_to_the_floor():
    plain = _small_search()
    tailed = _small_search(tail_evals=5)
    assert tailed["goodput"] == plain["goodput"]                 # the crossing is the same search
    top = max(x for x, _ in plain["points"])
    extra = sorted(p for p in tailed["points"] if p not in plain["points"])
    assert 0 < len(extra) <= 5
    grid = curve_rates(0.5, 64.0)
    assert all(x > top and any(abs(x - g) <= 1e-9 * g for g in grid) for x, _ in extra)
    # consecutive grid points above the search, stopping at the first one under the floor
    above = [g for g in grid if g > top * (1 + 1e-9)]
    assert [x for x, _ in extra] == pytest.approx(above[:len(extra)])
    assert all(a >= 0.5 for _, a in extra[:-1])
    assert extra[-1][1] < 0.5 or len(extra) == 5 or len(extra) == len(above)


def test_the_tail_takes_the_area_credit_a_cliff_got_from_its_last_point():
    """A policy that falls off a cliff just past its crossing, held flat from its last search
    point, out-scores by area one with a higher crossing measured further; measured above its
    last point it does not."""
    cliff = [(1.0, 1.0), (2.0, 1.0), (4.0, 0.95), (4.4, 0.88)]
    better = [(1.0, 1.0), (2.0, 1.0), (4.0, 1.0), (5.6, 0.93), (6.2, 0.9), (8.0, 0.78)]
    cells = [_cell("cliff", "baseline", 4.2, cliff), _cell("better", "adaptive", 6.2, better)]
    held = {r["entry"]: r for r in cell_ratios(cells, [Entry("cliff", "x", "baseline")])}
    assert held["better"]["area_ratio_vs_best_baseline"] < 1.0       # the artefact
    tail = cliff + [(5.66, 0.3)]
    cells = [_cell("cliff", "baseline", 4.2, tail), _cell("better", "adaptive", 6.2, better)]
    measured = {r["entry"]: r for r in cell_ratios(cells, [Entry("cliff", "x", "baseline")])}
    assert measured["better"]["area_ratio_vs_best_baseline"] > 1.0
