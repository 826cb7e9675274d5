"""The instance runtime shared by the simulator and the engine (pure: no torch)."""

from laneserve.runtime.instance import Instance

__all__ = ["Instance"]
