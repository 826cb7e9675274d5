"""Simulation experiments shared by ``laneserve sim`` and the benchmark scripts: named policy
sets, rate sweeps, goodput and SLO-scale searches over a workload."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from laneserve.measure.search import SearchResult, goodput_search, slo_scale_search
from laneserve.measure.simulate import run_point
from laneserve.costmodel.base import CostModel
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import Workload

if TYPE_CHECKING:
    from laneserve.measure.parallel import RayWorkers

ROW_KEYS = ("request_throughput", "output_throughput", "attainment_ttft", "attainment_tpot",
            "attainment_both", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p90_tpot_ms", "p99_tpot_ms", "mean_queue_ms", "completed", "failed", "rejected")


def policy_config(spec: str, base: ClusterConfig) -> ClusterConfig:
    """A cluster config for a policy-set spec: ``PREFILL+DECODE`` for a disaggregated cluster
    (e.g. ``cp-edf-2k+continuous``), ``PREFILL`` alone (decode from ``base``), or
    ``colocated[:opts]`` for colocated instances."""
    spec = spec.strip()
    if spec.split(":", 1)[0] == "colocated":
        return replace(base, mode="colocated", colocated_policy=spec)
    prefill, _, decode = spec.partition("+")
    return replace(base, mode="disaggregated", prefill_policy=prefill,
                   decode_policy=decode or base.decode_policy)


def split_policy_sets(text: str) -> list[str]:
    """Split ``a+b,c:k=v,k2=v2`` into policy sets: a comma followed by ``key=value`` continues
    the previous set's options; commas inside square brackets (a nested spec) never split."""
    from laneserve.policies.registry import split_top_level
    sets: list[str] = []
    for piece in split_top_level(text):
        if sets and re.match(r"^\s*[A-Za-z_][\w-]*=", piece):
            sets[-1] += "," + piece
        elif piece.strip():
            sets.append(piece.strip())
    return sets


def validate(config: ClusterConfig, cost: CostModel) -> None:
    """Build the cluster's policies once, so a bad name or option fails before a long run."""
    from laneserve.runtime.cluster import make_routers
    Simulator(config, cost)._make_instances()
    make_routers(config.deployment, lambda: (cost, None))


def row(policy: str, rate: float, summary: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {"policy": policy, "rate": rate, **{k: summary.get(k) for k in ROW_KEYS}, **extra}


def point_row(workload: Workload, name: str, config: ClusterConfig, cost: CostModel, rate: float,
              slo_scale: float = 1.0) -> dict[str, Any]:
    """One (policy, rate) point of a sweep as a report row (a module-level function: it runs in
    worker processes too)."""
    return row(name, rate, run_point(workload, config, cost, rate=rate, slo_scale=slo_scale)[0])


def sweep(workload: Workload, policies: Mapping[str, ClusterConfig], rates: Sequence[float],
          cost: CostModel, *, slo_scale: float = 1.0,
          on_point: Callable[[str, float], None] | None = None, jobs: int | RayWorkers = 1) -> list[dict[str, Any]]:
    """Every (policy, rate) point, in policy-then-rate order, over ``jobs`` processes (or Ray tasks)."""
    from laneserve.measure.parallel import map_jobs
    tasks = [(workload, name, config, cost, rate, slo_scale) for name, config in policies.items() for rate in rates]
    done = None if on_point is None else (lambda i: on_point(tasks[i][1], tasks[i][4]))
    return map_jobs(point_row, tasks, jobs, on_done=done)


def goodput(workload: Workload, config: ClusterConfig, cost: CostModel, *, lo: float, hi: float,
            target: float = 0.9, metric: str = "attainment_both", slo_scale: float = 1.0,
            rel_tol: float = 0.02, max_evals: int = 20) -> SearchResult:
    """Highest request rate at which ``metric`` stays ≥ ``target`` (DistServe's goodput)."""
    def attainment(rate: float) -> float:
        return run_point(workload, config, cost, rate=rate, slo_scale=slo_scale)[0][metric]
    return goodput_search(attainment, lo=lo, hi=hi, target=target, rel_tol=rel_tol, max_evals=max_evals)


def policy_goodput(workload: Workload, config: ClusterConfig, cost: CostModel, lo: float, hi: float,
                   target: float, slo_scale: float) -> SearchResult:
    """:func:`goodput` with positional arguments, for :func:`~laneserve.measure.parallel.map_jobs`."""
    return goodput(workload, config, cost, lo=lo, hi=hi, target=target, slo_scale=slo_scale)


def policy_slo_scale(workload: Workload, config: ClusterConfig, cost: CostModel, rate: float,
                     target: float) -> SearchResult:
    """:func:`tightest_slo_scale` with positional arguments, for ``map_jobs``."""
    return tightest_slo_scale(workload, config, cost, rate=rate, target=target)


def tightest_slo_scale(workload: Workload, config: ClusterConfig, cost: CostModel, *, rate: float,
                       lo: float = 0.05, hi: float = 20.0, target: float = 0.9,
                       metric: str = "attainment_both", rel_tol: float = 0.02) -> SearchResult:
    def attainment(scale: float) -> float:
        return run_point(workload, config, cost, rate=rate, slo_scale=scale)[0][metric]
    return slo_scale_search(attainment, lo=lo, hi=hi, target=target, rel_tol=rel_tol)
