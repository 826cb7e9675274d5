"""Rank entry points that fail on purpose (spawned by reference, so they live in an importable
module): rank 1 exits before it joins its group, or right after."""

from __future__ import annotations

import sys

from laneserve.engine.tp.group import join


def exits_before_join(spec, rank, handle, parent_pid) -> None:
    sys.exit(3)


def exits_after_join(spec, rank, handle, parent_pid) -> None:
    join(spec, rank)
    sys.exit(4)
