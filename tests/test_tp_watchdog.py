"""``RankWatchdog``: once a rank is gone it gives rank 0 ``grace_s`` to go down by itself, then
calls ``on_lost`` with the lost ranks in words; disarmed, it never calls it."""

from __future__ import annotations

import threading
import time

from laneserve.engine.tp.watchdog import RankWatchdog


class _Group:
    def __init__(self) -> None:
        self.gone = ""
        self.looked = threading.Event()

    def lost(self) -> str:
        self.looked.set()
        return self.gone


def test_a_lost_rank_not_handled_within_the_grace_calls_on_lost_once():
    group, calls, called = _Group(), [], threading.Event()
    dog = RankWatchdog(group, lambda lost: (calls.append(lost), called.set()), grace_s=0.2, poll_s=0.01).start()
    assert group.looked.wait(10)
    assert not calls                                        # every rank alive: nothing happens
    group.gone = "rank 1 (pid 7) exited with code -9"
    assert called.wait(10), "the watchdog never fired"
    dog._thread.join(10)
    assert calls == ["rank 1 (pid 7) exited with code -9"] and not dog._thread.is_alive()


def test_rank_zero_going_down_itself_disarms_it():
    group, calls = _Group(), []
    dog = RankWatchdog(group, calls.append, grace_s=0.3, poll_s=0.01).start()
    group.gone = "rank 1 (pid 7) exited with code -9"
    time.sleep(0.05)                                        # it has seen the loss and waits out the grace
    dog.disarm()
    dog._thread.join(10)
    assert not dog._thread.is_alive() and calls == []
