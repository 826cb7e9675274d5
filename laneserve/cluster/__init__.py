"""Running engine instances together: routing, KV transfer between prefill and decode instances,
and process launch (:mod:`.process`: the router side; :mod:`.worker`: an instance process;
:mod:`.stub`: a no-model measurement harness; :mod:`.transport`: KV transports).

``LocalCluster`` is imported lazily so that the router and stub processes never import torch."""

from __future__ import annotations

__all__ = ["LocalCluster"]


def __getattr__(name: str):
    if name == "LocalCluster":
        from laneserve.cluster.local import LocalCluster
        return LocalCluster
    raise AttributeError(f"module 'laneserve.cluster' has no attribute {name!r}")
