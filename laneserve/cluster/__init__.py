"""Running engine instances together: routing, KV transfer between prefill and decode instances,
and (in later work) process launch."""

from laneserve.cluster.local import LocalCluster

__all__ = ["LocalCluster"]
