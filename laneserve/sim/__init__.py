"""Torch-free discrete-event simulator that runs the same scheduler code as the engine against a
cost model (docs/design.md, "What laneserve is")."""

from laneserve.sim.config import ClusterConfig
from laneserve.sim.executor import SimExecutor
from laneserve.sim.simulator import SimResult, Simulator, simulate

__all__ = ["ClusterConfig", "SimExecutor", "SimResult", "Simulator", "simulate"]
