"""Scheduling policies (torch-free): prefill/, decode/, routing, colocated, and the registry
that selects them by name (``laneserve.policies.registry``)."""

from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.policies.registry import available, make, parse_spec

__all__ = ["InstanceScheduler", "StepOutcome", "available", "make", "parse_spec"]
