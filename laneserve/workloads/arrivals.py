"""Arrival processes: Poisson and gamma (bursty) request arrivals, deterministic by seed.

Serving papers drive synthetic workloads with a Poisson process at rate λ (LAPS §4, FlowPrefill
§6, DistServe); burstiness is modelled with gamma-distributed inter-arrival times whose coefficient
of variation ``cv`` is > 1 (cv = 1 is exactly Poisson: the gamma with shape 1 is the exponential).

For a gamma inter-arrival time with mean ``1/rate`` and coefficient of variation ``cv`` the shape
is ``k = 1/cv²`` and the scale ``θ = 1/(rate·k)``. The first request arrives at time 0, so ``n``
arrivals have ``n - 1`` gaps and the mean gap is ``1/rate``.
"""

from __future__ import annotations

import numpy as np

PROCESSES = ("poisson", "gamma")


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not (rate > 0 and np.isfinite(rate)):
        raise ValueError(f"arrival rate must be a finite number > 0 req/s, got {rate!r}")


def _times_from_gaps(gaps: np.ndarray, start: float) -> np.ndarray:
    times = np.empty(len(gaps) + 1, dtype=np.float64)
    times[0] = 0.0
    np.cumsum(gaps, out=times[1:])
    return times + start


def poisson_gaps(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` exponential inter-arrival gaps with mean ``1/rate`` seconds."""
    _check(n, rate)
    return rng.exponential(1.0 / rate, size=n)


def gamma_gaps(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` gamma inter-arrival gaps with mean ``1/rate`` and coefficient of variation ``cv``."""
    _check(n, rate)
    if not (cv > 0 and np.isfinite(cv)):
        raise ValueError(f"coefficient of variation cv must be a finite number > 0, got {cv!r}")
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def poisson_arrivals(n: int, rate: float, seed: int = 0, *, start: float = 0.0) -> np.ndarray:
    """Arrival times (seconds, ascending, first at ``start``) of ``n`` Poisson arrivals."""
    _check(n, rate)
    if n == 0:
        return np.empty(0)
    return _times_from_gaps(poisson_gaps(n - 1, rate, np.random.default_rng(seed)), start)


def gamma_arrivals(n: int, rate: float, cv: float = 1.0, seed: int = 0, *,
                   start: float = 0.0) -> np.ndarray:
    """Arrival times of ``n`` requests with gamma(cv) inter-arrival gaps (cv > 1: bursty)."""
    _check(n, rate)
    if n == 0:
        return np.empty(0)
    return _times_from_gaps(gamma_gaps(n - 1, rate, cv, np.random.default_rng(seed)), start)


def arrival_times(process: str, n: int, rate: float, *, cv: float = 1.0, seed: int = 0,
                  start: float = 0.0) -> np.ndarray:
    """Dispatch by name: ``"poisson"`` (``cv`` must be 1) or ``"gamma"``."""
    if process == "poisson":
        if cv != 1.0:
            raise ValueError(f"a Poisson process has cv = 1; use process='gamma' for cv={cv}")
        return poisson_arrivals(n, rate, seed, start=start)
    if process == "gamma":
        return gamma_arrivals(n, rate, cv, seed, start=start)
    raise ValueError(f"unknown arrival process {process!r}; choose one of {', '.join(PROCESSES)}")
