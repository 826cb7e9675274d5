"""One simulated point: a workload run through the simulator and summarised.

Here, not in ``bench``, because the planner sizes deployments with it as the benchmarks do, and the
planner is a serving layer that does not depend on the benchmark tooling.
"""

from __future__ import annotations

from typing import Any

from laneserve.costmodel.base import CostModel
from laneserve.measure.metrics import summarize
from laneserve.sim import ClusterConfig, Simulator
from laneserve.workloads import Workload


def run_point(workload: Workload, config: ClusterConfig, cost: CostModel, *, rate: float | None = None,
              slo_scale: float = 1.0) -> tuple[dict[str, Any], Any]:
    """Simulate ``workload`` (rescaled to ``rate`` if given) and summarise it."""
    wl = workload.with_rate(rate) if rate is not None else workload
    result = Simulator(config, cost).run(wl.specs, slo_scale=slo_scale)
    summary = summarize(result.requests, duration=result.duration)
    summary["sim_wall_seconds"] = result.wall_seconds
    summary["instances"] = result.instances
    return summary, result
