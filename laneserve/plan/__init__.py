"""Deployment planning (``laneserve plan``): the cheapest layout meeting a workload's SLOs."""

from .planner import (Layout, PlanResult, PlanSpec, attainment_curve, bound, evaluate, layout_of, plan,
                      serve_command)

__all__ = ["Layout", "PlanResult", "PlanSpec", "attainment_curve", "bound", "evaluate", "layout_of",
           "plan", "serve_command"]
