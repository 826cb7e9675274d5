"""The policy league: goodput of every policy entry on every workload and cluster shape.

A league is workloads x shapes x entries (x predictor modes when the simulator has them). Each
cell is a goodput search (:func:`search_cell`: the highest request rate at which >= 90% of the
requests meet both their TTFT and TPOT targets, each evaluation a run of :class:`RunLength`
requests), and the cells run in parallel
over :func:`laneserve.measure.parallel.map_jobs`. The harness is data-driven:

- :class:`LeagueWorkload` — a named workload with its SLO rule written down (the rule is also
  applied by the builder, so the text and the run cannot disagree silently: the builder sets the
  SLOs and the text is printed with the results);
- :class:`Entry` — one policy set (``prefill+decode``, a router, a kind: baseline, paper,
  composition, router, baseline-router or adaptive). An entry whose prefill/decode policy or router is not
  registered is *skipped* and reported as such, so adding ``adaptive+adaptive`` to a list is one
  line that activates when the policy exists;
- :func:`run_league` runs the cells; :func:`league_metrics` reduces them to the issue's ratios
  (adaptive vs the best baseline and the best other entry, the worst paper policy vs the best
  baseline, the worst router vs least-loaded), each a minimum over workloads, shapes and modes,
  with where it was reached; :func:`plot_heatmap` draws goodput / best baseline per cell.

A paper mechanism that is one half of a policy pair (AlignedServe is a decode policy) is judged
with the baseline policy it is paired with best: paper entries that share a ``paper`` label form a
group, and the group's ratio on a cell is its best member's (``fcfs+alignedserve`` and
``cp-edf-2k+alignedserve`` judge AlignedServe against the best baseline with only the decode policy
swapped). Routers are held against least-loaded with the same policies, except the baseline
routers (round-robin), which are reported but not held.

A goodput that is never met (not even at the bottom of the search range, after one retry an
order of magnitude lower) counts as 0 in the ratios; a ratio whose denominator is 0 is left out
of the minimum and listed under ``undefined``.

How sure a goodput is. Bisection finds *a* rate where attainment crosses 90%; where the curve
runs flat near 90% over a wide range of rates (a *plateau*: long contexts that miss their TPOT
whatever the policy keep every good policy at 0.87-0.93), which policy crosses last is decided by
a few requests, and the crossing can differ by 1.5x for an attainment difference of 0.03. So
beside it the league reports, per cell:

- the **area goodput** (:func:`area_goodput`): with ``curve_evals`` > 0 each search also
  evaluates the half-octave grid ``lo x 2^(k/2)`` up to the first rate whose attainment falls
  below :data:`CURVE_FLOOR`; the attainment curve (every evaluation, linear in log-rate, held
  flat beyond a cell's own first and last points) is integrated over the log-rate range that
  the cells of its workload, shape and mode share, each point weighted ``min(attainment / 0.9,
  1)``, and turned back into a rate: ``lo x exp(area)``, the crossing of a curve that is at
  target up to there and 0 beyond. On a steep curve it sits near the crossing; on a plateau a
  0.03 attainment difference moves it by a few percent, not by the plateau's width. With
  ``tail_evals`` > 0 each search also follows the grid *above* its highest rate down to the
  floor, so no cell's curve is its last search point held flat over rates nobody measured:
  without it, a policy whose search stopped just past its crossing (attainment 0.88 there) was
  credited 0.88 up to the top of the range, where the better policies, measured, sat at 0.78;
- a **plateau** mark: the evaluated rates whose attainment is within :data:`PLATEAU_BAND` of
  the target span a factor of at least :data:`PLATEAU_SPAN` (``plateau_range`` gives them). A
  ratio is marked when either side of it (the entry or the best baseline) sits on a plateau.

:func:`league_metrics` gives the headline ratios on both figures (``adaptive_min_area_ratio_*``
beside the crossing ones).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from laneserve.measure.simulate import run_point
from laneserve.measure.search import goodput_search
from laneserve.costmodel.base import CostModel
from laneserve.sim import ClusterConfig
from laneserve.workloads import Workload
from laneserve.workloads.traces import IdleLatencySLO

#: cluster shapes: name -> (prefill instances, decode instances)
SHAPES: dict[str, tuple[int, int]] = {"1P+1D": (1, 1), "4P+4D": (4, 4)}
KINDS = ("baseline", "paper", "composition", "router", "baseline-router", "adaptive")
DEFAULT_ROUTER = "least-loaded"
TARGET = 0.9               # the attainment goodput asks for
CURVE_FLOOR = 0.5          # the attainment curve is followed down to here
PLATEAU_BAND = 0.03        # attainment within this of the target...
PLATEAU_SPAN = 1.5         # ...over at least this factor of rates: a plateau


@dataclass(slots=True, frozen=True)
class LeagueWorkload:
    """A league workload: ``build(n, cost)`` returns its first ``n`` requests with SLOs set by
    the rule that ``slo_rule`` states; ``prefill_opts`` go to every entry's prefill policy."""

    name: str
    slo_rule: str
    build: Callable[[int, CostModel], Workload]
    description: str = ""
    prefill_opts: dict[str, Any] = field(default_factory=dict)
    shapes: tuple[str, ...] = tuple(SHAPES)       # the cluster shapes it runs on


@dataclass(slots=True, frozen=True)
class Entry:
    """One contender. ``router`` None means the shape's default (least-loaded); ``reference`` names
    the entry a router entry is held against (least-loaded with the same policies); paper entries
    with the same ``paper`` are one group, judged by its best member per cell."""

    prefill: str
    decode: str
    kind: str
    router: str | None = None
    shapes: tuple[str, ...] = tuple(SHAPES)
    paper: str = ""
    reference: str | None = None
    decode_router: str | None = None      # None: the run's default ("auto")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"entry kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def name(self) -> str:
        name = f"{self.prefill}+{self.decode}"
        if self.router:
            name += f"@{self.router}"
        return name + f"@decode={self.decode_router}" if self.decode_router else name


@dataclass(slots=True)
class Cell:
    """One goodput search's outcome."""

    workload: str
    shape: str
    entry: str
    kind: str
    mode: str
    goodput: float | None
    evals: int
    saturated: bool
    monotone: bool
    points: list[tuple[float, float]]
    wall_s: float
    max_requests: int = 0            # the largest evaluation's request count


def predictor_modes() -> tuple[str, ...]:
    """The predictor axis: ``("online", "oracle")`` when the simulator's config has a ``predictor``
    field, else one mode, ``"default"`` (whatever the policies do today)."""
    return ("online", "oracle") if "predictor" in {f.name for f in fields(ClusterConfig)} else ("default",)


def missing_policy(entry: Entry) -> str | None:
    """Why ``entry`` cannot run (an unregistered policy or router, or a bad option), or None."""
    from laneserve.policies import registry
    for kind, spec in (("prefill", entry.prefill), ("decode", entry.decode),
                       ("router", entry.router or DEFAULT_ROUTER)):
        try:
            registry.resolve(kind, spec)
        except ValueError as exc:         # not registered, or options it does not take
            name = registry.parse_spec(spec)[0]
            if name not in registry.available(kind):
                return f"{kind} policy {name!r} is not registered"
            return f"{kind} policy {name!r}: {exc}"
    return None


def entry_config(entry: Entry, shape: str, workload: LeagueWorkload, mode: str, *,
                 host_kv_tokens: int) -> ClusterConfig:
    n_prefill, n_decode = SHAPES[shape]
    cfg = ClusterConfig(num_prefill=n_prefill, num_decode=n_decode, prefill_policy=entry.prefill,
                        decode_policy=entry.decode, router=entry.router or DEFAULT_ROUTER,
                        host_kv_tokens=host_kv_tokens, prefill_opts=dict(workload.prefill_opts),
                        decode_router=entry.decode_router or "auto")
    return cfg if mode == "default" else replace(cfg, predictor=mode)


def idle_prefill_time(spec, cost: CostModel, *, cached: bool = False) -> float:
    """A request's prefill alone on an idle instance: the whole prompt, or with ``cached`` (prefix
    caching on) only its new tokens after ``prefix_len``."""
    done = spec.prefix_len if cached else 0
    return cost.prefill_time([(max(spec.prompt_len - done, 1), done)])


def idle_multiple_slo(workload: Workload, cost: CostModel, *, multiple: float, floor: float,
                      tpot: float) -> Workload:
    """Every request's TTFT target = ``max(floor, multiple x its idle prefill time)``; TPOT ``tpot``
    (the ``--trace`` rule of :class:`~laneserve.workloads.traces.IdleLatencySLO`, a fixed TPOT)."""
    return IdleLatencySLO(ttft_multiple=multiple, ttft_floor=floor).apply(workload, cost, tpot=tpot)


def capacity_estimate(workload: Workload, cost: CostModel, num_prefill: int, *, cached: bool = False) -> float:
    """Requests/s the prefill instances could take if every prompt ran alone on an idle instance:
    the anchor of the goodput search range."""
    mean = sum(idle_prefill_time(s, cost, cached=cached) for s in workload.specs) / max(len(workload), 1)
    return num_prefill / max(mean, 1e-6)


@dataclass(slots=True, frozen=True)
class RunLength:
    """How many requests one evaluation of a search simulates: at least ``min_requests`` and
    enough for ``duration`` seconds of arrivals at the evaluated rate (``None``: exactly
    ``min_requests``), at most what the workload holds. A fixed count at a high rate is a burst
    of a second or two that ends before a backlog builds: on FlowPrefill's mix at 4P+4D 400
    requests put every policy's goodput at about four times what a run of 6,400 sustains."""

    min_requests: int
    duration: float | None = None

    def requests(self, rate: float, available: int) -> int:
        want = self.min_requests if self.duration is None else max(self.min_requests,
                                                                   math.ceil(rate * self.duration))
        return min(want, available)


def curve_rates(lo: float, hi: float) -> list[float]:
    """The half-octave grid ``lo x 2^(k/2)`` up to ``hi``."""
    rates, k = [], 0
    while (rate := lo * 2.0 ** (k / 2)) <= hi * (1 + 1e-12):
        rates.append(rate)
        k += 1
    return rates


def search_cell(workload: Workload, config: ClusterConfig, cost: CostModel, lo: float, hi: float,
                rel_tol: float, max_evals: int, length: RunLength | None = None,
                curve_evals: int = 0, tail_evals: int = 0) -> dict[str, Any]:
    """One goodput search (module level: it runs in worker processes). Not met at ``lo``: one
    more search, over ``[lo/16, lo]``. Each evaluation simulates the first ``length.requests(rate)``
    requests of ``workload`` at the rate (all of them without ``length``). With ``curve_evals``,
    up to that many more evaluations follow the attainment curve on the half-octave grid from the
    search's bottom (:func:`curve_rates`), skipping rates already evaluated, until it falls below
    :data:`CURVE_FLOOR` (for :func:`area_goodput`). With ``tail_evals``, up to that many more
    follow the same grid *above* the highest rate evaluated so far, until the attainment falls
    below :data:`CURVE_FLOOR`: the area then integrates measured points up to where the curve has
    fallen, not the last point of the search held flat (which credits a policy that fell off a
    cliff just past its crossing with near-target attainment at every higher rate)."""
    t0 = time.perf_counter()
    length = length or RunLength(len(workload))
    sizes: list[int] = []

    def attainment(rate: float) -> float:
        n = length.requests(rate, len(workload))
        sizes.append(n)
        return run_point(workload.head(n), config, cost, rate=rate)[0]["attainment_both"]

    res = goodput_search(attainment, lo=lo, hi=hi, rel_tol=rel_tol, max_evals=max_evals)
    points = list(res.points)
    bottom = lo
    if not res.met:
        bottom = lo / 16
        res = goodput_search(attainment, lo=bottom, hi=lo, rel_tol=rel_tol, max_evals=max_evals)
        points += res.points
    curve = 0
    for rate in curve_rates(bottom, hi):
        if curve >= curve_evals:
            break
        seen = [a for x, a in points if abs(x - rate) <= 1e-9 * rate]
        if seen:
            value = seen[0]
        else:
            value = attainment(rate)
            points.append((rate, value))
            curve += 1
        if value < CURVE_FLOOR:
            break
    top_rate, value = max(points)
    for rate in [r for r in curve_rates(bottom, hi) if r > top_rate * (1 + 1e-9)][:tail_evals]:
        if value < CURVE_FLOOR:
            break
        value = attainment(rate)
        points.append((rate, value))
    return {"goodput": res.value, "evals": len(points), "saturated": res.saturated,
            "monotone": res.monotone, "points": sorted(points), "wall_s": time.perf_counter() - t0,
            "max_requests": max(sizes)}


def _curve_at(points: Sequence[tuple[float, float]], log_rate: float) -> float:
    """Attainment at ``exp(log_rate)``: linear in log-rate between evaluated points, flat beyond."""
    xs = [math.log(x) for x, _ in points]
    if log_rate <= xs[0]:
        return points[0][1]
    if log_rate >= xs[-1]:
        return points[-1][1]
    i = next(k for k in range(1, len(xs)) if xs[k] >= log_rate)
    x0, x1 = xs[i - 1], xs[i]
    a0, a1 = points[i - 1][1], points[i][1]
    return a0 if x1 == x0 else a0 + (a1 - a0) * (log_rate - x0) / (x1 - x0)


def area_goodput(points: Sequence[tuple[float, float]], lo: float, hi: float, target: float = TARGET) -> float | None:
    """``lo x exp(∫ min(a(r) / target, 1) d ln r)`` over ``[lo, hi]`` (see the module docstring);
    None without points."""
    pts = sorted((x, a) for x, a in points if not math.isnan(a))
    if not pts or hi <= lo:
        return None if not pts else lo
    knots = sorted({math.log(lo), math.log(hi), *(math.log(x) for x, _ in pts if lo < x < hi)})
    area = 0.0
    for u, v in zip(knots, knots[1:]):
        # the curve is linear between knots; the weight min(a / target, 1) is piecewise linear:
        # integrate it on a fine enough split of the segment
        steps = 8
        for j in range(steps):
            a = u + (v - u) * j / steps
            b = u + (v - u) * (j + 1) / steps
            wa = min(_curve_at(pts, a) / target, 1.0)
            wb = min(_curve_at(pts, b) / target, 1.0)
            area += 0.5 * (wa + wb) * (b - a)
    return lo * math.exp(area)


def plateau(points: Sequence[tuple[float, float]], target: float = TARGET) -> tuple[float, float] | None:
    """The span of evaluated rates whose attainment is within :data:`PLATEAU_BAND` of ``target``,
    when it covers a factor of at least :data:`PLATEAU_SPAN`; else None."""
    near = [x for x, a in points if abs(a - target) <= PLATEAU_BAND]
    if len(near) >= 2 and max(near) >= PLATEAU_SPAN * min(near):
        return (min(near), max(near))
    return None


def run_league(workloads: Sequence[LeagueWorkload], entries: Sequence[Entry], cost: CostModel, *,
               sizes: dict[str, int], shapes: Sequence[str] = tuple(SHAPES),
               modes: Sequence[str] | None = None, jobs: int = 1, rel_tol: float = 0.04,
               max_evals: int = 14, host_kv_tokens: int = 1_000_000, duration: float | None = None,
               max_sizes: dict[str, int] | None = None, curve_evals: int = 0, tail_evals: int = 0,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every (workload, shape, entry, mode) cell; ``sizes`` gives the requests per evaluation for
    each shape, or with ``duration`` the least of them (:class:`RunLength`: enough requests for
    ``duration`` seconds of arrivals at each evaluated rate, at most ``max_sizes``, whose first
    requests the workload is built with); ``curve_evals`` and ``tail_evals`` as :func:`search_cell`. Returns
    ``{"cells", "skipped", "modes", "ranges", "wall_s"}``."""
    from laneserve.measure.parallel import map_jobs
    if duration is not None and not max_sizes:
        raise ValueError("duration needs max_sizes: the requests the workloads are built with")
    modes = tuple(modes or predictor_modes())
    skipped = {e.name: why for e in entries if (why := missing_policy(e)) is not None}
    runnable = [e for e in entries if e.name not in skipped]
    tasks, keys, ranges = [], [], {}
    for lw in workloads:
        for shape in shapes:
            if shape not in lw.shapes:
                continue
            length = RunLength(sizes[shape], duration)
            wl = lw.build(sizes[shape] if duration is None else max_sizes[shape], cost)
            cap = capacity_estimate(wl, cost, SHAPES[shape][0],
                                    cached=bool(lw.prefill_opts.get("prefix_caching")))
            lo, hi = cap / 4, cap * 32
            ranges[f"{lw.name} {shape}"] = {"lo": lo, "hi": hi, "requests": len(wl),
                                            "min_requests": min(sizes[shape], len(wl))}
            for entry in runnable:
                if shape not in entry.shapes:
                    continue
                for mode in modes:
                    cfg = entry_config(entry, shape, lw, mode, host_kv_tokens=host_kv_tokens)
                    tasks.append((wl, cfg, cost, lo, hi, rel_tol, max_evals, length, curve_evals, tail_evals))
                    keys.append((lw.name, shape, entry, mode))
    t0 = time.perf_counter()
    done = [0]

    def on_done(i: int) -> None:
        done[0] += 1
        if progress is not None:
            w, shape, entry, mode = keys[i]
            elapsed = time.perf_counter() - t0
            eta = elapsed / done[0] * (len(tasks) - done[0])
            progress(f"[{done[0]}/{len(tasks)}] {w} {shape} {entry.name}"
                     f"{'' if mode == 'default' else f' ({mode})'} "
                     f"({elapsed:.0f} s elapsed, ~{eta:.0f} s left)")

    results = map_jobs(search_cell, tasks, jobs, on_done=on_done)
    cells = [Cell(workload=w, shape=shape, entry=entry.name, kind=entry.kind, mode=mode, **res)
             for (w, shape, entry, mode), res in zip(keys, results)]
    return {"cells": cells, "skipped": skipped, "modes": list(modes), "ranges": ranges,
            "wall_s": time.perf_counter() - t0}


def _ratio(num: float | None, den: float | None) -> float | None:
    if den is None or den <= 0:
        return None
    return (num or 0.0) / den


def cell_ratios(cells: Iterable[Cell], entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """One row per cell: goodput, the best baseline's goodput on its (workload, shape, mode), the
    ratio to it, for paper entries their group's best ratio (``paper_ratio_vs_best_baseline``), and
    for router entries the ratio to their reference entry; beside them the same on the area
    goodput (``area_*``, over the log-rate range the cells of the (workload, shape, mode) share)
    and the plateau marks (``plateau``: this cell; ``plateau_ratio``: this cell or its best
    baseline)."""
    cells = list(cells)
    by_key = {(c.workload, c.shape, c.mode, c.entry): c for c in cells}
    refs = {e.name: e.reference for e in entries}
    papers = {e.name: e.paper for e in entries}
    spans: dict[tuple, tuple[float, float]] = {}
    for c in cells:
        if c.points:
            k = (c.workload, c.shape, c.mode)
            xs = [x for x, _ in c.points]
            lo, hi = spans.get(k, (min(xs), max(xs)))
            spans[k] = (min(lo, *xs), max(hi, *xs))
    area = {c.entry + "|" + "|".join((c.workload, c.shape, c.mode)):
            area_goodput(c.points, *spans[(c.workload, c.shape, c.mode)]) if c.points else None for c in cells}

    def area_of(c: Cell) -> float | None:
        return area[c.entry + "|" + "|".join((c.workload, c.shape, c.mode))]

    best_base: dict[tuple, float] = {}
    best_base_cell: dict[tuple, Cell] = {}
    best_base_area: dict[tuple, float] = {}
    for c in cells:
        if c.kind == "baseline":
            k = (c.workload, c.shape, c.mode)
            if k not in best_base or (c.goodput or 0.0) > best_base[k]:
                best_base_cell[k] = c
            best_base[k] = max(best_base.get(k, 0.0), c.goodput or 0.0)
            best_base_area[k] = max(best_base_area.get(k, 0.0), area_of(c) or 0.0)
    rows = []
    for c in cells:
        k = (c.workload, c.shape, c.mode)
        base = best_base.get(k)
        others = [o for o in cells if (o.workload, o.shape, o.mode) == k and o.entry != c.entry and o.kind != "adaptive"]
        best_other = max((o.goodput or 0.0 for o in others), default=None)
        best_other_area = max((area_of(o) or 0.0 for o in others), default=None)
        ref = by_key.get((*k, refs.get(c.entry))) if refs.get(c.entry) else None
        group = ([o for o in cells if (o.workload, o.shape, o.mode) == k and o.kind == "paper"
                  and papers.get(o.entry) == papers[c.entry]] if papers.get(c.entry) else [c])
        group_best = max(group, key=lambda o: o.goodput or 0.0) if c.kind == "paper" else None
        own_plateau = plateau(c.points)
        base_cell = best_base_cell.get(k)
        base_plateau = plateau(base_cell.points) if base_cell is not None else None
        rows.append({"workload": c.workload, "shape": c.shape, "mode": c.mode, "entry": c.entry,
                     "kind": c.kind, "goodput": c.goodput, "best_baseline": base,
                     "ratio_vs_best_baseline": _ratio(c.goodput, base),
                     "best_other": best_other, "ratio_vs_best_other": _ratio(c.goodput, best_other),
                     "reference": ref.entry if ref else None,
                     "ratio_vs_reference": _ratio(c.goodput, ref.goodput) if ref else None,
                     "paper_group_best": group_best.entry if group_best else None,
                     "paper_ratio_vs_best_baseline": (_ratio(group_best.goodput, base) if group_best
                                                      else None),
                     "area_goodput": area_of(c), "area_best_baseline": best_base_area.get(k),
                     "area_ratio_vs_best_baseline": _ratio(area_of(c), best_base_area.get(k)),
                     "area_best_other": best_other_area,
                     "area_ratio_vs_best_other": _ratio(area_of(c), best_other_area),
                     "area_ratio_vs_reference": _ratio(area_of(c), area_of(ref)) if ref else None,
                     "plateau": own_plateau is not None, "plateau_range": own_plateau,
                     "plateau_ratio": own_plateau is not None or base_plateau is not None,
                     "evals": c.evals, "saturated": c.saturated, "monotone": c.monotone,
                     "max_requests": c.max_requests})
    return rows


def _min_over(rows: Iterable[dict[str, Any]], key: str) -> dict[str, Any]:
    rows = list(rows)
    defined = [r for r in rows if r[key] is not None]
    undefined = [f"{r['workload']} {r['shape']} {r['entry']}" for r in rows if r[key] is None]
    if not defined:
        return {"value": None, "where": None, "cells": 0, "undefined": undefined}
    worst = min(defined, key=lambda r: r[key])
    where = f"{worst['entry']} on {worst['workload']} {worst['shape']}" + (
        "" if worst["mode"] == "default" else f" ({worst['mode']})")
    return {"value": worst[key], "where": where, "cells": len(defined), "undefined": undefined}


def league_metrics(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The issue's headline ratios (each a minimum over workloads, shapes and modes; None when
    no cell qualifies, e.g. adaptive not registered) and, beside them, where each was reached."""
    specs = {
        "adaptive_min_ratio_vs_best_baseline": ("adaptive", "ratio_vs_best_baseline"),
        "adaptive_min_ratio_vs_best_policy": ("adaptive", "ratio_vs_best_other"),
        "adaptive_min_area_ratio_vs_best_baseline": ("adaptive", "area_ratio_vs_best_baseline"),
        "adaptive_min_area_ratio_vs_best_policy": ("adaptive", "area_ratio_vs_best_other"),
        "worst_paper_policy_ratio_vs_best_baseline": ("paper", "paper_ratio_vs_best_baseline"),
        "worst_router_ratio_vs_least_loaded": ("router", "ratio_vs_reference"),
    }
    metrics, detail = {}, {}
    for name, (kind, key) in specs.items():
        found = _min_over((r for r in rows if r["kind"] == kind), key)
        if found["value"] is None and "area" in key and not any(r[key] is not None for r in rows):
            continue                       # no curves evaluated: no area figures
        metrics[name] = found["value"]
        detail[name] = found
    metrics["plateau_cells"] = sum(1 for r in rows if r["plateau"])
    return metrics, detail


def plot_heatmap(path, rows: Sequence[dict[str, Any]], *, shapes: Sequence[str], mode: str,
                 title: str = "") -> None:
    """Workloads x entries per shape; colour = goodput / best baseline's goodput (red < 1 < green)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    rows = [r for r in rows if r["mode"] == mode]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    per_shape = {s: list(dict.fromkeys(r["entry"] for r in rows if r["shape"] == s)) for s in shapes}
    finite = [r["ratio_vs_best_baseline"] for r in rows if r["ratio_vs_best_baseline"] is not None]
    vmax = max(2.0, max(finite, default=2.0))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
    widths = [max(len(per_shape[s]), 1) for s in shapes]
    fig = Figure(figsize=(2.0 + 0.62 * sum(widths), 1.6 + 0.42 * len(workloads)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shapes), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    image = None
    for ax, shape in zip(axes, shapes):
        entries = per_shape[shape]
        grid = np.full((len(workloads), len(entries)), np.nan)
        for r in rows:
            if r["shape"] == shape and r["ratio_vs_best_baseline"] is not None:
                grid[workloads.index(r["workload"]), entries.index(r["entry"])] = r["ratio_vs_best_baseline"]
        image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not math.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(entries)), entries, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(workloads)), workloads if ax is axes[0] else [""] * len(workloads),
                      fontsize=7)
        ax.set_title(shape, fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="goodput / best baseline")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
