"""A tensor-parallel prefill in miniature for the cross-rank stop protocol's tests.

Each rank runs a generator of ``LAYERS * 5`` operators on its own
:class:`~laneserve.engine.device_stream.EmulatedAsyncStream` (launches complete later, each
rank's device at its own speed). Operators 3 and 4 of every layer (``o_proj``, ``down``) end in an
all-reduce, so a rank that parks while another waits inside one deadlocks the group. The launch
loop is the executor's (``EngineExecutor._advance``): at most ``bound`` operators in flight at a
boundary, a park drains the device.

Collectives: :class:`FakeAllReduce` (threads: a barrier with a timeout, sum in rank order) or
gloo (``torch.distributed`` in spawned processes). Either way a wait is bounded: a deadlock
raises instead of hanging. ``NaiveStop`` is the protocol with the agreement removed: every rank
parks at the first boundary where it sees rank 0's flag."""

from __future__ import annotations

import threading
from collections import deque

import torch

from laneserve.engine.device_stream import EmulatedAsyncStream
from laneserve.engine.tp.stop_protocol import StopBoard, StopProtocol, stoppable_boundaries

LAYERS = 4
TOTAL = LAYERS * 5
DIM = 8
REDUCED = (3, 4)          # operators of a layer that end in an all-reduce


class FakeAllReduce:
    """A sum over ranks (in rank order, so every rank gets identical bits) among threads."""

    def __init__(self, world: int, timeout: float) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        out = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        return out


def gloo_all_reduce(rank: int, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    x = x.clone()
    dist.all_reduce(x)
    return x


def weights(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(TOTAL, 2, DIM, generator=g)


def forward(rank: int, all_reduce, w: torch.Tensor):
    """The rank's prefill as a generator: one yield per operator, the result returned."""
    x = torch.linspace(-1, 1, DIM)
    for op in range(TOTAL):
        # elementwise and exactly rounded (no kernel choice can change the bits): a rank's operator
        x = (x * w[op, 0] + w[op, 1]).clamp(-2.0, 2.0)
        if op % 5 in REDUCED:
            x = all_reduce(rank, x)
        if op < TOTAL - 1:
            yield
    return x


class NaiveStop:
    """The agreement removed: rank 0 raises a flag, each rank parks where it first sees it."""

    def __init__(self, flag: threading.Event | dict, rank: int) -> None:
        self.flag, self.rank, self.parked_at = flag, rank, None

    def begin(self, num_boundaries: int) -> None:
        pass

    def boundary(self, op_index: int, want_stop: bool = False) -> bool:
        if self.rank == 0 and want_stop:
            self.flag.set()
        if self.flag.is_set():
            self.parked_at = op_index
            return True
        return False


class Rank:
    """One rank's executor state: its stream, its protocol end, the plan in progress."""

    def __init__(self, rank: int, protocol, all_reduce, op_delay: float = 0.0) -> None:
        self.rank, self.protocol, self.all_reduce = rank, protocol, all_reduce
        self.stream = EmulatedAsyncStream(op_delay)
        self.w = weights(rank)
        self.gen = None
        self.ops_done = 0

    def start(self) -> None:
        self.gen, self.ops_done = forward(self.rank, self.all_reduce, self.w), 0

    def advance(self, bound: int, stop_at: int | None = None):
        """Run the plan on (the executor's loop) to its end, ``("done", result)``, or to a park,
        ``("parked", op)``. Rank 0 wants a stop at its boundary after operator ``stop_at``."""
        result: list[torch.Tensor] = []
        gen, stream, proto = self.gen, self.stream, self.protocol

        def operator() -> None:
            try:
                next(gen)
            except StopIteration as done:
                result.append(done.value)

        proto.begin(stoppable_boundaries(self.ops_done, TOTAL, "operator"))
        inflight: deque = deque(maxlen=max(bound, 1))
        while self.ops_done < TOTAL:
            stream.launch(operator)
            self.ops_done += 1
            if self.ops_done == TOTAL:
                break
            if bound:
                inflight.append(stream.record())
                while len(inflight) > bound - 1:
                    stream.wait(inflight.popleft())
            want = self.rank == 0 and stop_at is not None and self.ops_done >= stop_at   # wanted until it lands
            if proto.boundary(self.ops_done, want_stop=want):
                stream.wait(stream.record())
                return "parked", self.ops_done
        stream.synchronize()
        return "done", result[0]

    def close(self) -> None:
        self.stream.close()


def process_rank(rank: int, world: int, board_name: str, store: str, delays: list[float],
                 trials: list[tuple[int, int]], out) -> None:
    """A spawned rank with gloo collectives: for each (stop_at, bound), run, park, resume; put
    ``(rank, [(parked_op or None, launched_before_resume, result)])`` on ``out``."""
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    board = StopBoard.attach(board_name, world)
    proto = StopProtocol(board, rank, timeout=60.0)
    me = Rank(rank, proto, gloo_all_reduce, delays[rank])
    runs = []
    try:
        for stop_at, bound in trials:
            me.start()
            state, value = me.advance(bound, stop_at)
            parked = value if state == "parked" else None
            launched = me.ops_done
            if state == "parked":
                state, value = me.advance(bound)
            runs.append((parked, launched, value.tolist()))
        out.put((rank, runs))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        me.close()
        board.close()
        dist.destroy_process_group()
