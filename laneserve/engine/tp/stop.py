"""The one object every rank asks "stop here?" at an operator boundary of a preemptible step.

The answer must be the same on every rank, or a rank that parks leaves the others waiting inside
the next all-reduce. Rank 0 (which holds the scheduler) decides; :meth:`StopAgreement.leader`
takes its wish and returns the agreed answer, :meth:`StopAgreement.follower` returns that same
answer on the other ranks. With one rank it is the wish itself.

:class:`BroadcastStop` is the simple agreement: rank 0 broadcasts its answer at each allowed
boundary (one byte, on the group's CPU channel) and every rank waits for it. A protocol that lets
rank 0 publish "stop after operator k" without a round trip per boundary can replace it behind
:func:`make_stop_agreement`.
"""

from __future__ import annotations

import torch


class StopAgreement:
    """One rank: the wish is the answer."""

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


def make_stop_agreement(group, world: int) -> StopAgreement:
    """The agreement the ranks of a group of ``world`` use (``group``: a CPU process group)."""
    return StopAgreement() if world == 1 else BroadcastStop(group)
