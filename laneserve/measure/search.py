"""Searches over a run parameter (docs/design.md, "Measuring").

- :func:`goodput_search`: the highest request rate at which at least ``target`` (90%) of the
  requests meet every SLO — DistServe's per-GPU goodput, searched rather than swept.
- :func:`slo_scale_search`: the tightest SLO scale (both targets multiplied by it) at which the
  attainment still reaches ``target``.

Both evaluate a user function (usually a whole simulation) as few times as they can: geometric
bracketing from the end expected to pass, then bisection until the bracket is within ``rel_tol``
of the answer. They assume the attainment is monotone in the parameter but stay correct when it is
not: the answer is always a point that was *evaluated* and met the target (the best such point),
every evaluation is returned, and ``monotone`` says whether the evaluations contradicted the
assumption.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

#: called after every evaluation with (x, attainment, evaluations so far)
ProgressCallback = Callable[[float, float, int], None]


@dataclass(slots=True)
class SearchResult:
    """Outcome of a search. ``value`` is None when the target was never met."""

    value: float | None
    points: list[tuple[float, float]] = field(default_factory=list)   # (x, attainment) in order
    met: bool = False
    evals: int = 0
    saturated: bool = False          # met even at the far end of the range (the answer lies beyond)
    bound: float | None = None       # nearest evaluated x beyond ``value`` that missed the target
    monotone: bool = True            # the evaluations agree with the monotonicity assumption
    target: float = 0.9


def _search(f: Callable[[float], float], *, start: float, end: float, target: float,
            rel_tol: float, max_evals: int, growth: float,
            progress: ProgressCallback | None) -> SearchResult:
    """Find the x farthest from ``start`` towards ``end`` with ``f(x) >= target``.

    Attainment is assumed to pass near ``start`` and to fail towards ``end``.
    """
    if max_evals < 1:
        raise ValueError("max_evals must be >= 1")
    if growth <= 1.0:
        raise ValueError("growth must be > 1")
    if rel_tol <= 0:
        raise ValueError("rel_tol must be > 0")
    upward = end >= start
    result = SearchResult(value=None, target=target)

    def passes(x: float) -> bool:
        a = float(f(x))
        result.points.append((x, a))
        result.evals += 1
        if progress is not None:
            progress(x, a, result.evals)
        return not math.isnan(a) and a >= target

    def beyond(x: float, y: float) -> bool:      # x is farther from start than y
        return x > y if upward else x < y

    if not passes(start):
        _finish(result, upward)
        return result
    good, bad = start, None
    result.saturated = start == end
    # geometric bracketing: step away from start until a miss or the end of the range
    while result.evals < max_evals and good != end:
        nxt = good * growth if upward else good / growth
        if beyond(nxt, end) or nxt == good:
            nxt = end
        if nxt == good:
            break
        if passes(nxt):
            good = nxt
            if nxt == end:
                result.saturated = True
                break
        else:
            bad = nxt
            break
    # bisection between the last pass and the first miss
    while bad is not None and result.evals < max_evals and abs(bad - good) > rel_tol * abs(good):
        mid = 0.5 * (good + bad)
        if passes(mid):
            good = mid
        else:
            bad = mid
    _finish(result, upward)
    return result


def _finish(result: SearchResult, upward: bool) -> None:
    """Best passing point, nearest miss beyond it, and a monotonicity check over all points."""
    ok = [(x, a) for x, a in result.points if not math.isnan(a) and a >= result.target]
    if ok:
        best = max(x for x, _ in ok) if upward else min(x for x, _ in ok)
        result.value, result.met = best, True
        misses = [x for x, a in result.points if (x > best if upward else x < best)]
        if misses:
            result.bound = min(misses) if upward else max(misses)
    else:
        result.saturated = False
    # monotone: ordering the points from start towards end, attainment never increases
    pts = sorted(result.points, reverse=not upward)
    result.monotone = all(not (a2 > a1 + 1e-12) for (_, a1), (_, a2) in zip(pts, pts[1:])
                          if not (math.isnan(a1) or math.isnan(a2)))


def goodput_search(attainment_at: Callable[[float], float], *, lo: float, hi: float,
                   target: float = 0.9, rel_tol: float = 0.02, max_evals: int = 20,
                   growth: float = 2.0, progress: ProgressCallback | None = None) -> SearchResult:
    """Highest rate in ``[lo, hi]`` whose attainment is ``>= target``.

    Starts at ``lo``, multiplies the rate by ``growth`` until attainment misses the target (or
    ``hi`` is reached: ``saturated``), then bisects until the bracket is ``rel_tol`` of the rate.
    Never met at ``lo``: ``met=False, value=None``.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo}, hi={hi}")
    return _search(attainment_at, start=lo, end=hi, target=target, rel_tol=rel_tol,
                   max_evals=max_evals, growth=growth, progress=progress)


def slo_scale_search(attainment_at_scale: Callable[[float], float], *, lo: float, hi: float,
                     target: float = 0.9, rel_tol: float = 0.02, max_evals: int = 20,
                     growth: float = 2.0,
                     progress: ProgressCallback | None = None) -> SearchResult:
    """Smallest SLO scale in ``[lo, hi]`` whose attainment is ``>= target``.

    Attainment should not decrease as the scale (looser SLOs) grows. Starts at ``hi`` and divides
    by ``growth`` until a miss (or ``lo`` is reached: ``saturated``), then bisects. Never met at
    ``hi``: ``met=False, value=None``.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo}, hi={hi}")
    return _search(attainment_at_scale, start=hi, end=lo, target=target, rel_tol=rel_tol,
                   max_evals=max_evals, growth=growth, progress=progress)
