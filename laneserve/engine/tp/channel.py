"""Rank 0's once-per-step broadcast to the other ranks of its group: one pickled message written
into a memory-mapped buffer that every rank maps, and one semaphore per reader saying it is there
(the scheme of nano-vllm: no socket, no per-layer traffic). Semaphores, not ``Event``s: setting a
multiprocessing ``Event`` waits for every sleeping waiter to wake, so a reader killed while it
waited would hang the writer; a semaphore's release never waits.

The buffer is a file under ``/dev/shm`` (the temp folder where there is none) with a name
unique to the instance. Rank 0 unlinks it as soon as every rank has mapped it
(:meth:`StepChannel.unlink`), so nothing is left in ``/dev/shm`` even if the group is killed.
A writer waits until every reader has taken the previous message before writing the next.
Readers wait in slices of ``poll_s`` and give up when ``alive()`` turns false (their parent is
gone), so a rank never outlives its instance.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_HEADER = struct.Struct("<Q")


def shm_folder() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def sweep_stale(prefixes: tuple[str, ...] = ("laneserve-tp-", "laneserve-stop-")) -> list[str]:
    """Remove group files (``PREFIX<pid>-<id>``) whose creating process is gone: a rank 0 killed
    during start-up, before every rank had mapped them, leaves them behind. Returns their names."""
    removed = []
    for f in shm_folder().iterdir():
        if not f.name.startswith(prefixes):
            continue
        pid = f.name.split("-")[2]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            f.unlink()
            removed.append(f.name)
        except OSError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one ``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ChannelClosed(RuntimeError):
    """The writer is gone (a reader's ``alive()`` turned false)."""


@dataclass
class ChannelHandle:
    """What a reader process needs to attach (picklable for the spawn context)."""

    path: str
    capacity: int
    ready: object          # multiprocessing Semaphore: a message is waiting for this reader
    taken: object          # multiprocessing Semaphore: this reader has copied it out


class StepChannel:
    """One writer (rank 0), ``readers`` readers. Create with :meth:`create` on rank 0 (before the
    readers are spawned), attach with :meth:`attach` in each reader."""

    def __init__(self, path: str, capacity: int, buf: mmap.mmap, events: list[tuple[object, object]]) -> None:
        self.path = path
        self.capacity = capacity
        self._buf = buf
        self._events = events
        self.bytes_sent = 0
        self.last_size = 0

    @classmethod
    def create(cls, ctx, readers: int, capacity: int = 64 << 20) -> StepChannel:
        path = str(shm_folder() / f"laneserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, capacity)
            buf = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        events = [(ctx.Semaphore(0), ctx.Semaphore(1)) for _ in range(readers)]
        return cls(path, capacity, buf, events)

    def handle(self, reader: int) -> ChannelHandle:
        ready, taken = self._events[reader]
        return ChannelHandle(self.path, self.capacity, ready, taken)

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def publish(self, message: object, alive: Callable[[], bool] = lambda: True, poll_s: float = 1.0) -> int:
        """Write ``message`` for every reader; returns its size in bytes."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + _HEADER.size > self.capacity:
            raise ValueError(f"step message of {len(data)} B exceeds the channel's {self.capacity} B")
        for _, taken in self._events:
            while not taken.acquire(timeout=poll_s):
                if not alive():
                    raise ChannelClosed("a rank stopped reading the step channel")
        _HEADER.pack_into(self._buf, 0, len(data))
        self._buf[_HEADER.size:_HEADER.size + len(data)] = data
        for ready, _ in self._events:
            ready.release()
        self.bytes_sent += len(data)
        self.last_size = len(data)
        return len(data)

    def close(self) -> None:
        self.unlink()
        self._buf.close()


class ChannelReader:
    def __init__(self, handle: ChannelHandle) -> None:
        fd = os.open(handle.path, os.O_RDWR)
        try:
            self._buf = mmap.mmap(fd, handle.capacity)
        finally:
            os.close(fd)
        self._ready, self._taken = handle.ready, handle.taken

    def receive(self, alive: Callable[[], bool], poll_s: float = 1.0) -> object:
        while not self._ready.acquire(timeout=poll_s):
            if not alive():
                raise ChannelClosed("the step channel's writer is gone")
        (size,) = _HEADER.unpack_from(self._buf, 0)
        data = bytes(self._buf[_HEADER.size:_HEADER.size + size])
        self._taken.release()
        return pickle.loads(data)

    def close(self) -> None:
        self._buf.close()
