"""Deadline priorities and the TTFT predictor behind them (FlowPrefill §5.2, eq. 3; ablations §6.3).

FlowPrefill ranks requests by ``priority = sgn(x) / deadline`` in *descending* order, where
``deadline`` is the absolute TTFT deadline (arrival + TTFT SLO) and

- S-EDF (``"sedf"``): ``x = slack = deadline - now - TTFT̂(remaining tokens)``;
- D-EDF (``"dedf"``): ``x = deadline - now``;
- naive EDF (``"edf"``): ``x = 1`` (plain earliest deadline first).

Reading the formula literally (deadlines are positive clock times):

- every request with ``x >= 0`` (it can still make it) ranks above every request with ``x < 0``;
  among the first, earliest deadline first (``1/d`` descending);
- among the late ones ``-1/d`` descending puts the *latest* deadline first (the most recent /
  loosest of the hopeless requests);
- ``sgn(0)`` is taken as +1 (the paper: "the highest priority is the one with the earliest deadline
  and non-negative slack"); a request without a TTFT target (deadline = inf, priority 0) ranks
  between the two groups;
- ties (equal priority) break by arrival time, then request id (FCFS).

:func:`priority_key` returns a tuple whose *ascending* order is that descending priority order,
using exact comparisons instead of ``1/d`` floats. LAPS lanes (or any queue) can order by it:
``sorted(reqs, key=lambda r: priority_key("sedf", r, now, predictor(r.remaining_prefill)))``.

The predictor is FlowPrefill's TTFT polynomial (§6.4, "fits a polynomial to offline prefill
profiles"): :class:`~laneserve.costmodel.PolynomialTTFT` fitted to the cost model bound to the
instance (oracle or profile, :mod:`laneserve.policies.predictors`), or the quadratic of a
:class:`~laneserve.policies.predictors.LearnedCostModel` learned online from observed step times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from laneserve.core.request import Request
from laneserve.costmodel.fitted import PolynomialTTFT
from laneserve.policies.predictors import LearnedCostModel, LearnedTTFT

INF = float("inf")

#: (ordering, x, deadline) -> sort key; x is the quantity whose sign the priority takes
PriorityKey = tuple[int, float, float, int]


#: a key's first element: slack non-negative, no deadline, late (negative slack)
ON_TIME, NO_DEADLINE, LATE = 0, 1, 2


def _signed_key(x: float, deadline: float, arrival: float, rid: int) -> PriorityKey:
    if deadline == INF:
        return (NO_DEADLINE, 0.0, arrival, rid)
    if x >= 0:
        return (ON_TIME, deadline, arrival, rid)        # +1/d descending == d ascending
    return (LATE, -deadline, arrival, rid)              # -1/d descending == d descending


def sedf_key(req: Request, now: float, predicted: float) -> PriorityKey:
    d = req.ttft_deadline
    return _signed_key(d - now - predicted, d, req.arrival_time, req.request_id)


def dedf_key(req: Request, now: float, predicted: float) -> PriorityKey:
    d = req.ttft_deadline
    return _signed_key(d - now, d, req.arrival_time, req.request_id)


def edf_key(req: Request, now: float, predicted: float) -> PriorityKey:
    return _signed_key(1.0, req.ttft_deadline, req.arrival_time, req.request_id)


def fcfs_key(req: Request, now: float, predicted: float) -> PriorityKey:
    return (0, req.arrival_time, 0.0, req.request_id)


#: the orderings' names, as an option type (the keys of ORDERINGS)
Ordering = Literal["sedf", "dedf", "edf", "fcfs"]

#: name -> key(request, now, predicted remaining prefill seconds); ascending = highest priority first
ORDERINGS: dict[str, Callable[[Request, float, float], PriorityKey]] = {
    "sedf": sedf_key, "dedf": dedf_key, "edf": edf_key, "fcfs": fcfs_key,
}


def priority_key(ordering: str, req: Request, now: float, predicted: float = 0.0) -> PriorityKey:
    try:
        return ORDERINGS[ordering](req, now, predicted)
    except KeyError:
        raise ValueError(f"unknown ordering {ordering!r}; choose one of {', '.join(ORDERINGS)}") from None


# ---- the TTFT predictor -------------------------------------------------------------------------
class _Horner:
    """Fast scalar evaluation of a fitted PolynomialTTFT (numpy per call costs ~10 µs; ranking
    calls it once per queued request per event)."""

    __slots__ = ("coefficients",)

    def __init__(self, coefficients: Sequence[float]) -> None:
        self.coefficients = tuple(reversed(list(coefficients)))

    def __call__(self, tokens: float) -> float:
        acc = 0.0
        for c in self.coefficients:
            acc = acc * tokens + c
        return acc if acc > 0.0 else 0.0

    def nondecreasing(self, lo: float, hi: float) -> bool:
        """True when the polynomial cannot decrease on ``[lo, hi]`` (its derivative has no
        sign change there and is not negative at ``lo``); clamping at 0 keeps that."""
        deriv = np.polyder(np.array(self.coefficients[::-1]))
        if not deriv.size or not np.any(deriv):
            return True
        points = [lo, hi, *(r.real for r in np.roots(deriv) if abs(r.imag) < 1e-12 and lo < r.real < hi)]
        return all(np.polyval(deriv, x) >= 0 for x in points) and np.polyval(deriv, (lo + hi) / 2) >= 0


def never_negative(predict: Callable[[float], float]) -> bool:
    """True for the predictors built here, which clamp (polynomial) or have non-negative
    coefficients (learned)."""
    return isinstance(predict, (_Horner, LearnedTTFT))


def nondecreasing(predict: Callable[[float], float], hi: float) -> bool:
    """True when ``predict`` (one of the predictors built here, in its current fit) cannot
    decrease on ``[0, hi]`` tokens; False when unknown."""
    if isinstance(predict, LearnedTTFT):
        return True                       # a quadratic with non-negative coefficients
    return isinstance(predict, _Horner) and predict.nondecreasing(0.0, hi)


def make_predictor(predictor: Any = None, cost_model: Any = None) -> tuple[Callable[[float], float], bool]:
    """``(predict(tokens) -> seconds, learns_online)`` from an explicit predictor (a fitted
    :class:`PolynomialTTFT`, its ``to_dict()``, or any callable), else read from ``cost_model``
    (a :class:`LearnedCostModel` the instance feeds: a live view; any other: a polynomial fitted
    to its prefill times), else a :class:`LearnedTTFT` of the policy's own that it must feed
    (``learns_online`` True)."""
    if isinstance(predictor, dict):
        predictor = PolynomialTTFT.from_dict(predictor)
    if isinstance(predictor, PolynomialTTFT):
        return _Horner(predictor.coefficients), False
    if callable(predictor):
        return predictor, False
    if predictor is not None:
        raise ValueError(f"predictor must be a PolynomialTTFT, its dict or a callable, got {predictor!r}")
    if isinstance(cost_model, LearnedCostModel):
        return LearnedTTFT(cost_model), False
    if cost_model is not None:
        return _Horner(PolynomialTTFT.from_cost_model(cost_model).coefficients), False
    return LearnedTTFT(), True
