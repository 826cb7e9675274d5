"""A bound on how long an instance outlives a dead rank. On CPU (gloo) a step inside a collective
fails as soon as the dead peer's sockets close, and rank 0 goes down by itself; on CUDA (NCCL) a
collective with a dead peer can hang until its timeout, with rank 0's thread blocked in it. The
watchdog is a thread that looks at the rank processes; once one is gone and rank 0 has not gone
down by itself within ``grace_s`` (it calls :meth:`RankWatchdog.disarm` when it does), it calls
``on_lost`` with the lost ranks in words (the instance worker stops the other ranks and exits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RankWatchdog:
    def __init__(self, group, on_lost: Callable[[str], None], grace_s: float = 10.0, poll_s: float = 0.2) -> None:
        self.group = group
        self.on_lost = on_lost
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="laneserve-tp-watchdog", daemon=True)

    def start(self) -> RankWatchdog:
        self._thread.start()
        return self

    def disarm(self) -> None:
        """Rank 0 handles it (going down, or closing the group on purpose): never call ``on_lost``."""
        self._disarmed.set()

    def _watch(self) -> None:
        while not self._disarmed.wait(self.poll_s):
            lost = self.group.lost()
            if not lost:
                continue
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline:
                if self._disarmed.wait(self.poll_s):
                    return
            self.on_lost(lost)
            return
