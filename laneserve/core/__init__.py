"""Torch-free core: requests and SLOs, KV block accounting, plans and results, clocks, events."""

from laneserve.core.clock import Clock, VirtualClock, WallClock
from laneserve.core.kv import BlockPool, HostKVPool, KVCacheManager, KVOutOfMemory
from laneserve.core.plan import PrefillChunk, StepPlan, StepResult
from laneserve.core.request import Phase, Request, RequestSpec, RequestTimes
from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO, SLOClass

__all__ = [
    "SLO", "SLOClass", "BlockPool", "Clock", "HostKVPool", "KVCacheManager", "KVOutOfMemory",
    "Phase", "PrefillChunk", "Request", "RequestSpec", "RequestTimes", "SamplingParams", "StepPlan", "StepResult",
    "VirtualClock", "WallClock",
]
