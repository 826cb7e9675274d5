"""Operator-level preemption across the ranks of a tensor-parallel group: a stop decided by rank 0
takes effect on every rank at the *same* operator boundary.

Why it is needed: with tensor parallelism ``o_proj`` and ``down`` end in an all-reduce. If rank 1
parks after operator 12 while rank 0 already launched operator 13 (an all-reduce), rank 0 waits in
that all-reduce for a partner that will not come until the step resumes, and the step never ends:
a deadlock. Every rank must launch exactly the same operators before it parks.

The protocol ("rank 0 publishes *stop at boundary k*, with k at or past every rank's position"):

* Boundaries are counted over the group's life: every rank calls :meth:`StopProtocol.boundary` at
  each boundary where the plan allows a stop (the plan decides, so the sequence of boundaries is the
  same on every rank) and the counter ``c`` advances by one per call. ``c`` names the same boundary
  on every rank, across plans, parks and resumptions.
* Each rank publishes its counter in shared memory (``pos[r] = c``: one aligned 8-byte store),
  then reads the stop word (one load). That is the whole hot path when no stop is pending: no
  collective, no system call, no wait on another rank.
* Rank 0, at its boundary ``p0`` with a stop wanted (:meth:`request_stop` or ``boundary(want_stop=
  True)``): stores PENDING into the stop word, reads every ``pos[r]`` (``v_r``), and publishes
  ``k = max(p0, v_r + 1 for r != 0)``. A rank that reads PENDING waits at its boundary until ``k``
  is published (rank 0 does nothing blocking in between, so that wait is short and bounded).
  Because each side stores before it loads (with a full fence in between, below), either rank r
  saw PENDING at boundary ``v_r + 1`` at the latest, or rank 0 read its position: no rank can be
  past ``k`` when it learns ``k``. Every rank then runs on to boundary ``k`` and parks there.
* ``k`` past rank 0's last stoppable boundary of the current plan (a rank has already finished the
  plan): rank 0 publishes NONE instead, nobody parks, the step completes on every rank.
* A wish repeated while a published ``k`` is still ahead changes nothing: the stop is on its way.
* A published ``k`` stays in the word after the stop (every counter is past it then, so it is
  never met again). Before publishing a new one, rank 0 waits until every rank acknowledged the
  previous ``k`` (``ack[r] = k`` when it parks), which each rank does without needing rank 0.

Why this protocol rather than the ranks agreeing at each boundary (an all-reduce of a flag per
operator, FlowPrefill's "synchronized iteration counter"): that agreement costs a collective per
boundary on the hot path (on a GPU, a host round trip per operator, which also defeats the
asynchronous launch queue), while the publish protocol costs two memory accesses per boundary
and pays a short wait only when a stop is actually taken. Its price is that the stop may land a
few operators later than rank 0's own position when another rank is ahead.

Positions are operators *launched* (host side), not operators observed completed: what must be
identical across ranks is the set of operators each rank launches before parking, and the host
decides that; a completed count lags the launches on an asynchronous device (CUDA, the emulated
device), so a ``k`` computed from it could lie behind operators a rank already launched. The
executor's in-flight bound (``preempt_max_inflight``) still decides how far the device may lag
the host when the stop is checked; parking drains the device, and since every rank launched the
same operators, every collective among them completes.

The fence (store before load, on both sides) is asymmetric where Linux offers it: the ranks' hot
path has none, and rank 0, between storing PENDING and reading the positions, calls
``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)``, which makes every running thread of every
registered process (each rank registers when its protocol end is built) pass a full memory
barrier; a rank either published its position before that point, or reads PENDING after it.
Correct on any architecture, and a stop pays about a microsecond for it. Without ``membarrier``
(old kernels, seccomp) each boundary acquires and releases a private ``threading.Lock`` between
its store and its load: a locked read-modify-write, a full barrier on x86-64 (not on ARM, where a
board refuses that mode). The board records the mode so every rank uses the same. Shared memory
is a small file in ``/dev/shm`` mapped by every rank (threads may share an in-process board).
"""

from __future__ import annotations

import functools
import mmap
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

NONE = -1          # no stop published
PENDING = -2       # rank 0 is choosing k: ranks wait at their boundary
_WORD = 0          # slot of the stop word; then pos[0..n-1], then ack[0..n-1]
_FENCE = 1         # the board's fence mode (next to the stop word; written once by its creator)
LOCK_FENCE, MEMBARRIER_FENCE = 0, 1
_LINE = 8          # 8-byte words per slot: each slot on its own 64-byte cache line, so one rank's
                   # store does not evict the line another rank reads (no false sharing)


class StopProtocolError(RuntimeError):
    """The protocol was violated or a bounded wait ran out (a rank died or hangs)."""


class StopBoard:
    """The shared words of one group: the stop word, each rank's position and acknowledgement
(``board.pos(r)``, ``board.ack(r)`` give their indices in ``words``).

    ``StopBoard(n)`` lives in this process (ranks as threads); ``StopBoard.create(n)`` maps a new
    file in shared memory whose ``name`` other processes pass to ``StopBoard.attach``; the
    creator's :meth:`close` unlinks it."""

    def __init__(self, world_size: int, *, fence: str = "auto", _buffer=None, _path: Path | None = None,
                 _owner: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.path, self._owner = _path, _owner
        self._buffer = _buffer if _buffer is not None else bytearray(self.nbytes(world_size))
        self.words = memoryview(self._buffer).cast("q")
        if _owner or _path is None:
            self.words[_FENCE] = _fence_mode(fence)
            self.words[_WORD] = NONE
            for r in range(world_size):
                self.words[self.pos(r)] = -1
                self.words[self.ack(r)] = NONE

    @property
    def fence(self) -> int:
        """``LOCK_FENCE`` or ``MEMBARRIER_FENCE`` (chosen by the board's creator)."""
        return self.words[_FENCE]

    def pos(self, rank: int) -> int:
        return (1 + rank) * _LINE

    def ack(self, rank: int) -> int:
        return (1 + self.world_size + rank) * _LINE

    @staticmethod
    def nbytes(world_size: int) -> int:
        return 8 * _LINE * (1 + 2 * world_size)

    @classmethod
    def create(cls, world_size: int, directory: str | Path | None = None, fence: str = "auto") -> StopBoard:
        from laneserve.cluster.transport import default_shm_dir
        path = Path(directory or default_shm_dir()) / f"laneserve-stop-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(path, "w+b") as f:
            f.truncate(cls.nbytes(world_size))
            buf = mmap.mmap(f.fileno(), cls.nbytes(world_size))
        return cls(world_size, fence=fence, _buffer=buf, _path=path, _owner=True)

    @classmethod
    def attach(cls, name: str | Path, world_size: int) -> StopBoard:
        path = Path(name)
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), cls.nbytes(world_size))
        return cls(world_size, _buffer=buf, _path=path)

    @property
    def name(self) -> str | None:
        return str(self.path) if self.path is not None else None

    def close(self) -> None:
        """Unmap (and unlink, on the creator). Idempotent."""
        words, self.words = self.words, None
        if words is not None:
            words.release()
            if isinstance(self._buffer, mmap.mmap):
                self._buffer.close()
        if self._owner and self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._owner = False


class StopProtocol:
    """One rank's end of the protocol (module docstring). Per plan run (a fresh step or a resumed
    one): ``begin(num_boundaries)``, then ``boundary(op_index)`` at each stoppable boundary, which
    returns True (identical on every rank) where the rank must park. Rank 0 asks for a stop with
    :meth:`request_stop` (any thread) or ``boundary(..., want_stop=True)``.

    ``timeout`` bounds every wait (raises :class:`StopProtocolError`): a rank never hangs on a
    dead partner. ``parked_at`` is the op index of the last park (for tests and logs)."""

    def __init__(self, board: StopBoard, rank: int, *, timeout: float = 60.0, poll: float = 20e-6) -> None:
        if not 0 <= rank < board.world_size:
            raise ValueError(f"rank {rank} outside a group of {board.world_size}")
        self.board, self.rank, self.timeout, self.poll = board, rank, timeout, poll
        self.counter = -1                # the last boundary this rank reached (lifetime count)
        self.last = -1                   # the counter of the current plan's last stoppable boundary
        self.parked_at: int | None = None
        self._fence_lock = threading.Lock()
        self._asymmetric = board.fence == MEMBARRIER_FENCE
        if self._asymmetric:
            _membarrier_register()
        self._wanted = False
        self._last_k = NONE              # rank 0: the last k it published
        self._parked_k = NONE            # the last k this rank parked at
        self._pos, self._ack = board.pos(rank), board.ack(rank)

    # ---- plan runs ------------------------------------------------------------------------
    def begin(self, num_boundaries: int) -> None:
        """A plan starts or resumes with ``num_boundaries`` stoppable boundaries before its end."""
        if num_boundaries < 0:
            raise ValueError(f"num_boundaries must be >= 0, got {num_boundaries}")
        self.last = self.counter + num_boundaries

    def gate(self, ops_done: int, total: int, granularity: str,
             wanted: Callable[[], bool] | None = None) -> Callable[[], bool]:
        """The ``should_stop`` to hand this rank's ``EngineExecutor.execute`` for one run of a
        preemptible plan (``plan.ops_done`` operators done of ``total``): it announces the run
        (:meth:`begin`) and calls :meth:`boundary` at each boundary the executor checks. On rank 0,
        ``wanted()`` is the scheduler's own ``should_stop``."""
        self.begin(stoppable_boundaries(ops_done, total, granularity))
        if wanted is not None and self.rank != 0:
            raise ValueError("only rank 0 decides a stop")

        def should_stop() -> bool:
            return self.boundary(want_stop=wanted is not None and wanted())
        return should_stop

    # the shape of a rank group's stop agreement: rank 0 leads with its wish, the others follow
    def begin_plan(self, ops_done: int, total: int, granularity: str) -> None:
        """:meth:`begin` for a run of a plan from ``ops_done`` of ``total`` operators."""
        self.begin(stoppable_boundaries(ops_done, total, granularity))

    def leader(self, wanted: bool) -> bool:
        """Rank 0 at a boundary: its scheduler's wish in, the group's answer out."""
        return self.boundary(want_stop=wanted)

    def follower(self) -> bool:
        """Ranks 1..N-1 at a boundary: the group's answer."""
        return self.boundary()

    def request_stop(self) -> None:
        """Rank 0: stop the current plan at the first boundary every rank can still reach."""
        if self.rank != 0:
            raise ValueError("only rank 0 decides a stop")
        self._wanted = True

    def boundary(self, op_index: int = -1, want_stop: bool = False) -> bool:
        """This rank reached a stoppable boundary (after launching operator ``op_index``): True
        when the group parks here."""
        if self.counter >= self.last:
            raise StopProtocolError(f"rank {self.rank}: more boundaries than begin() announced")
        self.counter += 1
        c, words = self.counter, self.board.words
        words[self._pos] = c
        if not self._asymmetric:
            lock = self._fence_lock      # the fence, inlined: the hot path
            lock.acquire()
            lock.release()
        if self.rank == 0 and (want_stop or self._wanted):
            self._wanted = False
            if self._last_k < c:          # else a stop is already on its way (wished again meanwhile)
                self._decide(c)
        word = words[_WORD]
        if word == PENDING:
            word = self._await_decision()
        if word == c:
            words[self._ack] = c
            self._parked_k, self.parked_at = c, op_index
            return True
        if c > word > self._parked_k:
            raise StopProtocolError(f"rank {self.rank} is at boundary {c}, past the stop at {word}")
        return False

    # ---- rank 0 -----------------------------------------------------------------------------
    def _decide(self, p0: int) -> None:
        board = self.board
        words, n = board.words, board.world_size
        if self._last_k != NONE:
            self._wait(lambda: all(words[board.ack(r)] == self._last_k for r in range(n)),
                       f"every rank to acknowledge the stop at {self._last_k}")
        words[_WORD] = PENDING
        if self._asymmetric:
            _membarrier(_MEMBARRIER_GLOBAL_EXPEDITED)
        else:
            self._fence()
        k = max([p0] + [words[board.pos(r)] + 1 for r in range(1, n)])
        if k > self.last:                # a rank finished this plan already: nobody parks
            words[_WORD] = NONE
            self._last_k = NONE
        else:
            words[_WORD] = k
            self._last_k = k

    # ---- waits ------------------------------------------------------------------------------
    def _await_decision(self) -> int:
        words = self.board.words
        self._wait(lambda: words[_WORD] != PENDING, "rank 0 to publish the stop boundary")
        return words[_WORD]

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline:
                raise StopProtocolError(f"rank {self.rank} waited {self.timeout:g} s for {what}")
            time.sleep(self.poll)

    def _fence(self) -> None:
        lock = self._fence_lock
        lock.acquire()
        lock.release()


def stoppable_boundaries(ops_done: int, total: int, granularity: str) -> int:
    """How many stoppable boundaries a plan passes from ``ops_done`` finished operators to its end
    (as the executor checks them: after operator ``i`` for ``ops_done < i < total``, every operator
    at "operator" granularity, every 5th at "layer", none at "chunk")."""
    if granularity == "chunk":
        return 0
    if granularity not in ("operator", "layer"):
        raise ValueError(f"unknown preempt_granularity {granularity!r}")
    every = 1 if granularity == "operator" else 5
    return sum(1 for i in range(ops_done + 1, total) if i % every == 0)


# ---- membarrier(2) -----------------------------------------------------------------------------
_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283}
_MEMBARRIER_QUERY, _MEMBARRIER_GLOBAL_EXPEDITED, _MEMBARRIER_REGISTER_GLOBAL_EXPEDITED = 0, 2, 4
_registered_pid: int | None = None


@functools.cache
def _syscall():
    import ctypes
    import platform
    nr = _SYS_MEMBARRIER.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        return None
    return functools.partial(ctypes.CDLL(None, use_errno=True).syscall, nr)


def _membarrier(cmd: int) -> int:
    call = _syscall()
    return -1 if call is None else call(cmd, 0, 0)


def membarrier_available() -> bool:
    """Whether this kernel offers the global expedited barrier (and lets this process use it)."""
    mask = _membarrier(_MEMBARRIER_QUERY)
    want = (1 << 1) | (1 << 2)           # GLOBAL_EXPEDITED and its registration
    return mask >= 0 and mask & want == want


def _membarrier_register() -> None:
    global _registered_pid
    if _registered_pid == os.getpid():
        return
    if _membarrier(_MEMBARRIER_REGISTER_GLOBAL_EXPEDITED) != 0:
        raise StopProtocolError("the stop board uses membarrier, which this process cannot register for")
    _registered_pid = os.getpid()


def _fence_mode(fence: str) -> int:
    if fence == "auto":
        fence = "membarrier" if membarrier_available() else "lock"
    if fence == "membarrier":
        if not membarrier_available():
            raise ValueError("membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) is not available here")
        return MEMBARRIER_FENCE
    if fence == "lock":
        import platform
        if platform.machine() not in ("x86_64", "AMD64", "i686", "i386"):
            raise ValueError(f"the lock fence is a full barrier only on x86, not on {platform.machine()}")
        return LOCK_FENCE
    raise ValueError(f"fence must be 'auto', 'membarrier' or 'lock', got {fence!r}")
