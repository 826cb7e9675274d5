"""The cross-rank stop protocol (laneserve/engine/tp/stop_protocol.py) on emulated asynchronous
devices with per-rank skew: every rank parks after the same operator, nobody hangs (every wait is
bounded and fails the test), the resumed plan gives the unstopped result on every rank; and the
protocol with the agreement removed is caught.

Ranks are threads with a barrier all-reduce for the 1,000 random stop points, and spawned
processes with gloo all-reduces and the board in shared memory for a few."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import threading
from pathlib import Path

import pytest
import torch

from laneserve.engine.tp.stop_protocol import (LOCK_FENCE, MEMBARRIER_FENCE, StopBoard, StopProtocol,
                                               StopProtocolError, membarrier_available, stoppable_boundaries)
from tp_stop_support import TOTAL, FakeAllReduce, NaiveStop, Rank, process_rank

WORLD = 4
WAIT_S = 60.0          # bounded waits of the correct protocol: reaching one fails the test
DELAYS = (0.0, 2e-5, 1e-4, 3e-4)


class Group:
    """``WORLD`` rank threads, each serving commands from its own queue."""

    def __init__(self, make_protocol, timeout: float, world: int = WORLD) -> None:
        self.world = world
        self.all_reduce = FakeAllReduce(world, timeout)
        self.ranks = [Rank(r, make_protocol(r), self.all_reduce) for r in range(world)]
        self.inbox = [queue.SimpleQueue() for _ in range(world)]
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, args=(r,), daemon=True) for r in range(world)]
        for t in self.threads:
            t.start()

    def _serve(self, r: int) -> None:
        rank = self.ranks[r]
        while (cmd := self.inbox[r].get()) is not None:
            fresh, bound, stop_at = cmd
            try:
                if fresh:
                    rank.start()
                self.outbox.put((r, *rank.advance(bound, stop_at), rank.ops_done))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.outbox.put((r, "error", exc, rank.ops_done))

    def run(self, fresh: bool, bound: int, stop_at: int | None, wait: float) -> dict:
        for q in self.inbox:
            q.put((fresh, bound, stop_at))
        out = {}
        for _ in range(self.world):
            try:
                r, state, value, launched = self.outbox.get(timeout=wait)
            except queue.Empty:
                return {"hang": True, **out}
            out[r] = (state, value, launched)
        return out

    def close(self) -> None:
        for q in self.inbox:
            q.put(None)
        for t in self.threads:
            t.join(5)
        for rank in self.ranks:
            rank.close()


def _reference(world: int = WORLD) -> torch.Tensor:
    """The plan's result without a stop (identical on every rank)."""
    board = StopBoard(world)
    group = Group(lambda r: StopProtocol(board, r), WAIT_S, world)
    try:
        out = group.run(True, 2, None, WAIT_S)
        assert all(out[r][0] == "done" and torch.equal(out[r][1], out[0][1]) for r in range(world))
        return out[0][1]
    finally:
        group.close()


def test_stoppable_boundaries_match_the_executor():
    assert stoppable_boundaries(0, 20, "operator") == 19
    assert stoppable_boundaries(7, 20, "operator") == 12
    assert stoppable_boundaries(0, 20, "layer") == 3      # after 5, 10, 15
    assert stoppable_boundaries(0, 20, "chunk") == 0
    with pytest.raises(ValueError, match="granularity"):
        stoppable_boundaries(0, 20, "token")


FENCES = [("membarrier", 1000), ("lock", 300)] if membarrier_available() else [("lock", 1000)]


@pytest.mark.parametrize("fence, trials", FENCES)
def test_thousand_random_stop_points_park_every_rank_at_one_operator(fence, trials):
    """1,000 random stop points with the fence this machine uses by default (membarrier where the
    kernel offers it), and a few hundred with the other one."""
    reference = _reference()
    board = StopBoard(WORLD, fence=fence)
    group = Group(lambda r: StopProtocol(board, r, timeout=WAIT_S), WAIT_S)
    rng = random.Random(38)
    parked_trials = 0
    try:
        for trial in range(trials):
            delays = list(DELAYS)
            rng.shuffle(delays)                   # the slow rank changes from trial to trial
            for rank, d in zip(group.ranks, delays):
                rank.stream.op_delay = d
            stop_at, bound = rng.randrange(1, TOTAL), rng.choice((0, 1, 2, 3))
            out = group.run(True, bound, stop_at, WAIT_S)
            assert "hang" not in out, f"trial {trial}: a rank hung ({out})"
            states = {r: out[r][0] for r in range(WORLD)}
            assert "error" not in states.values(), f"trial {trial}: {out}"
            if states[0] == "parked":
                parked_trials += 1
                ops = {out[r][1] for r in range(WORLD)}
                launched = {out[r][2] for r in range(WORLD)}
                assert set(states.values()) == {"parked"}, f"trial {trial}: {states}"
                assert len(ops) == 1 and ops == launched, f"trial {trial}: parked at {out}"
                assert ops.pop() >= stop_at
                out = group.run(False, bound, None, WAIT_S)
                assert "hang" not in out, f"trial {trial}: a rank hung on resume"
            for r in range(WORLD):
                assert out[r][0] == "done", f"trial {trial}: rank {r} {out[r]}"
                assert torch.equal(out[r][1], reference), f"trial {trial}: rank {r} differs"
    finally:
        group.close()
    assert parked_trials >= trials // 2       # most stops land inside the plan


def test_agreement_removed_is_caught():
    """Each rank parking where it sees the flag: ranks park at different operators, or one waits
    in an all-reduce its parked partner never joins (the barrier's bounded wait breaks)."""
    rng = random.Random(7)
    caught = 0
    for trial in range(10):
        flag = threading.Event()
        group = Group(lambda r, flag=flag: NaiveStop(flag, r), timeout=0.5)
        try:
            for rank, d in zip(group.ranks, (3e-4, 0.0, 0.0, 0.0)):   # rank 0 the slow one
                rank.stream.op_delay = d
            out = group.run(True, rng.choice((0, 2)), rng.randrange(1, TOTAL - 2), WAIT_S)
            ops = {out[r][1] for r in range(WORLD) if r in out and out[r][0] == "parked"}
            errors = [r for r in range(WORLD) if r in out and out[r][0] == "error"]
            if "hang" in out or errors or len(ops) > 1:
                caught += 1
        finally:
            group.all_reduce.barrier.abort()      # release a rank stuck in the deadlock
            group.close()
    assert caught >= 5


def test_rank_waiting_for_a_decision_that_never_comes_fails():
    board = StopBoard(2)
    board.words[0] = -2                        # rank 0 died while choosing k
    proto = StopProtocol(board, 1, timeout=0.05, poll=0.001)
    proto.begin(3)
    with pytest.raises(StopProtocolError, match="publish the stop boundary"):
        proto.boundary(1)


def test_bad_use_is_refused():
    board = StopBoard(2)
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        StopProtocol(board, 2)
    with pytest.raises(ValueError, match="only rank 0"):
        StopProtocol(board, 1).request_stop()
    proto = StopProtocol(board, 0)
    proto.begin(1)
    assert proto.boundary(1) is False
    with pytest.raises(StopProtocolError, match="more boundaries"):
        proto.boundary(2)


def test_a_stop_past_the_plan_is_dropped_on_every_rank():
    board = StopBoard(2)
    r0, r1 = StopProtocol(board, 0), StopProtocol(board, 1)
    r0.begin(3), r1.begin(3)
    assert [r1.boundary(i) for i in (1, 2, 3)] == [False] * 3      # rank 1 finished the plan
    r0.request_stop()
    assert r0.boundary(1) is False and board.words[0] == -1        # nobody parks
    assert [r0.boundary(i) for i in (2, 3)] == [False, False]


def test_processes_with_gloo_park_together_and_resume_identically(tmp_path: Path):
    world = 2
    reference = _reference(world).tolist()
    board = StopBoard.create(world)
    trials = [(3, 1), (8, 2), (14, 0), (1, 3), (17, 1)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=process_rank, args=(r, world, board.name, str(tmp_path / "store"),
                                                     [3e-4, 0.0], trials, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        board.close()
    for r in range(world):
        assert isinstance(got[r], list), f"rank {r}: {got[r]}"
    assert not Path(board.path).exists()
    for i, (stop_at, _bound) in enumerate(trials):
        parked = {got[r][i][0] for r in range(world)}
        launched = {got[r][i][1] for r in range(world)}
        assert len(parked) == 1 and len(launched) == 1, f"trial {i}: {[got[r][i][:2] for r in range(world)]}"
        op = parked.pop()
        assert op is None or (op >= stop_at and launched == {op})
        for r in range(world):
            assert got[r][i][2] == reference, f"trial {i}: rank {r} differs from the unstopped run"
    assert any(got[0][i][0] is not None for i in range(len(trials)))


GATE_CASES = [(2, (2e-3, 0.0), "operator"), (5, (0.0, 2e-3), "operator"), (1, (0.0, 1e-3), "layer"),
              (9, (0.0, 2e-3), "operator")]


def test_gate_drives_real_executors_to_one_boundary():
    """``StopProtocol.gate`` as each rank's ``should_stop`` in ``EngineExecutor.execute`` (two
    replicas of a tiny Qwen3 on emulated devices of different speeds, one per thread): both park
    after the same operator (or, when the other rank already finished the step, neither parks),
    and the resumed step samples what an unstopped one does."""
    from engine_support import Driver, make_executor, make_request, prompts

    def request():
        return make_request(0, prompts([21], seed=3)[0], 2, logprobs=3)

    _plan, ref = Driver(make_executor("qwen3")).step([(request(), 21)], [], preemptible=True)
    parked = 0
    for stop_after, delays, granularity in GATE_CASES:
        parked += _gate_case(ref, request, stop_after, delays, granularity)
    assert parked >= 1


def _gate_case(ref, request, stop_after, delays, granularity) -> bool:
    from engine_support import Driver, make_executor
    from laneserve.engine.device_stream import EmulatedAsyncStream

    board = StopBoard(2)
    protos = [StopProtocol(board, r, timeout=WAIT_S) for r in range(2)]
    executors = [make_executor("qwen3") for _ in range(2)]
    drivers = [Driver(ex) for ex in executors]
    for ex, d in zip(executors, delays):
        ex.stream = EmulatedAsyncStream(d)
    asked = [0]

    def wanted() -> bool:                       # rank 0's scheduler: stop at its stop_after-th check
        asked[0] += 1
        return asked[0] >= stop_after          # wished until the step returns, as a scheduler does

    plans = [None, None]
    outcome: dict = {}

    def run(r: int) -> None:
        ex, plan = executors[r], plans[r]
        gate = protos[r].gate(plan.ops_done if plan else 0, ex.num_operators, granularity,
                              wanted if r == 0 and plan is None else None)     # the resumed run: no wish
        if plan is None:
            plans[r], outcome[r] = drivers[r].step([(request(), 21)], [], preemptible=True,
                                                   granularity=granularity, should_stop=gate)
        else:
            _p, outcome[r] = drivers[r].step([], [], plan=plan, should_stop=gate)

    def both() -> None:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a rank hung"

    both()
    stopped = not outcome[0].completed
    assert outcome[1].completed != stopped, f"one rank parked, the other did not: {outcome}"
    launched = plans[0].ops_done + (0 if stopped else 1)      # a finished step launched its return too
    assert plans[0].ops_done == plans[1].ops_done
    assert executors[0].stream.launched == executors[1].stream.launched == launched
    if stopped:
        both()
    for r in range(2):
        assert outcome[r].completed and outcome[r].sampled == ref.sampled and outcome[r].logprobs == ref.logprobs
        executors[r].stream.close()
    return stopped


def test_leader_and_follower_are_the_boundary_of_rank_0_and_the_others():
    """The stop-agreement shape a rank group calls (leader on rank 0 with its wish, follower on the
    others): rank 0 wants a stop at its second boundary while rank 1 is at its third, so both park
    at the fourth (the first boundary rank 1 can still reach after its published position)."""
    board = StopBoard(2)
    lead, follow = StopProtocol(board, 0), StopProtocol(board, 1)
    lead.begin_plan(0, 10, "operator"), follow.begin_plan(0, 10, "operator")
    assert [follow.follower() for _ in range(3)] == [False] * 3
    assert [lead.leader(False), lead.leader(True), lead.leader(False), lead.leader(False)] == [False] * 3 + [True]
    assert follow.follower() is True
    assert lead.counter == follow.counter == 3           # both parked at boundary index 3 (the fourth)


def test_the_board_fixes_one_fence_for_every_rank(tmp_path: Path):
    auto = StopBoard.create(2, tmp_path)
    try:
        attached = StopBoard.attach(auto.name, 2)
        assert attached.fence == auto.fence == (MEMBARRIER_FENCE if membarrier_available() else LOCK_FENCE)
        attached.close()
        assert Path(auto.name).exists()                 # only the creator unlinks
    finally:
        auto.close()
    assert list(tmp_path.iterdir()) == []
    assert StopBoard(2, fence="lock").fence == LOCK_FENCE
    with pytest.raises(ValueError, match="fence must be 'auto', 'membarrier' or 'lock'"):
        StopBoard(2, fence="mfence")
