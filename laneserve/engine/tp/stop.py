"""The one object every rank asks "stop here?" at an operator boundary of a preemptible step.

The answer must be the same on every rank, or a rank that parks leaves the others waiting inside
the next all-reduce. Rank 0 (which holds the scheduler) decides; :meth:`StopAgreement.leader`
takes its wish and returns the agreed answer, :meth:`StopAgreement.follower` returns that same
answer on the other ranks. With one rank it is the wish itself.

Rank groups use :class:`~laneserve.engine.tp.stop_protocol.StopProtocol` (rank 0 publishes "stop
at boundary k" on a shared-memory board, k at or past every rank's position: no round trip per
boundary; see that module for why). :class:`BroadcastStop` is the simple alternative kept for
comparison: rank 0 broadcasts its answer at each allowed boundary (one byte, on the group's CPU
channel) and every rank waits for it. Every agreement is told where a plan run starts
(:meth:`StopAgreement.begin_plan`) before its first boundary.
"""

from __future__ import annotations

import torch


class StopAgreement:
    """One rank: the wish is the answer."""

    def begin_plan(self, ops_done: int, total: int, granularity: str) -> None:
        """A preemptible plan starts or resumes from ``ops_done`` of ``total`` operators."""

    def leader(self, wanted: bool) -> bool:
        return wanted

    def follower(self) -> bool:
        raise RuntimeError("a single rank has no leader to follow")


class BroadcastStop(StopAgreement):
    def __init__(self, group) -> None:
        self.group = group
        self._flag = torch.zeros(1, dtype=torch.uint8)
        self.boundaries = 0

    def leader(self, wanted: bool) -> bool:
        self.boundaries += 1
        self._flag[0] = int(wanted)
        self.group.broadcast([self._flag]).wait()
        return wanted

    def follower(self) -> bool:
        self.boundaries += 1
        self.group.broadcast([self._flag]).wait()
        return bool(self._flag[0])


def make_stop_agreement(group, world: int, rank: int = 0, board: str | None = None):
    """The agreement rank ``rank`` of a group of ``world`` uses: the published protocol on the
    shared-memory board named ``board``, or (no board) a broadcast per boundary on ``group``, a
    CPU process group."""
    if world == 1:
        return StopAgreement()
    if board is None:
        return BroadcastStop(group)
    from laneserve.engine.tp.stop_protocol import StopBoard, StopProtocol

    return StopProtocol(StopBoard.attach(board, world), rank)
