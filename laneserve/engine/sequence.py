"""One sequence of an engine step as the runner and the bucket runner both read it.

Its own module so that :mod:`laneserve.engine.runner` (which builds these from a step plan) and
:mod:`laneserve.engine.graphs` (which replays them through captured shapes, and which the runner
owns) share the type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.request import Request


@dataclass(slots=True)
class SeqInput:
    """One sequence of a step: ``token_ids`` at positions ``start ..``, sampled if ``sample``."""

    request: Request
    token_ids: list[int]
    start: int
    sample: bool
    is_decode: bool
