"""Measuring runs: per-request metrics and summaries, rate and SLO-scale searches, one simulated
point, parallel maps and progress bars.

Below both the benchmark tooling (``laneserve.bench``) and the serving layers that measure too (the
planner sizes deployments by simulating them; ``LLM`` shows progress), so neither imports ``bench``.
"""
