"""Where the engine's operators run, seen from the host: launch an operator, record a completion
marker after it, ask whether a marker has completed, wait for it.

A CUDA device runs the kernels the host launched *later* than the launch: the host can enqueue a
whole prefill's kernels within milliseconds while the device needs hundreds of milliseconds to run
them. A preemption check made at launch time therefore says nothing about how far the device got;
the preemptible forward (:meth:`laneserve.engine.executor.EngineExecutor._advance`) instead keeps
at most ``EngineConfig.preempt_max_inflight`` operators launched beyond the last one it observed
completed, so that a stop is acknowledged (and the device is idle again) within that many
operators' execution.

Three implementations of the same small interface:

* :class:`CudaStream`: ``torch.cuda.Event`` recorded on the current stream after each operator;
  ``query`` / ``synchronize`` on it.
* :class:`HostStream`: the CPU, where an operator has finished when its launch returns (markers
  are always complete; waiting is free).
* :class:`EmulatedAsyncStream`: a device emulated by a worker thread that runs the launched
  operator closures in order, each followed by a configurable delay, so launched work completes
  later than its launch as on a GPU. The CPU tests drive the preemption bound with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class DeviceStream:
    """Launch operators, mark them, observe their completion.

    ``launch(op)`` runs ``op``'s host part (on CPU and CUDA: ``op()`` itself, whose kernels a
    CUDA device runs later); ``record()`` returns a marker that completes when every operator
    launched so far has; ``query(marker)`` says whether it has, without blocking; ``wait(marker)``
    blocks the host until it has; ``synchronize()`` waits for all launched work. Results an ``op``
    returns are read by the caller only after waiting for a marker recorded after it."""

    #: whether launched work may complete after ``launch`` returns
    asynchronous: bool = False

    def launch(self, op: Callable[[], Any]) -> None:
        op()

    def record(self) -> Any:
        return None

    def query(self, marker: Any) -> bool:
        return True

    def wait(self, marker: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class HostStream(DeviceStream):
    """The CPU: an operator's work is done when its launch returns."""


class CudaStream(DeviceStream):
    """The current CUDA stream of ``device``; a marker is a ``torch.cuda.Event`` recorded on it
    (without timing, the cheapest kind)."""

    asynchronous = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def query(self, marker: torch.cuda.Event) -> bool:
        return marker.query()

    def wait(self, marker: torch.cuda.Event) -> None:
        marker.synchronize()

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class _Marker:
    __slots__ = ("index", "done")

    def __init__(self, index: int) -> None:
        self.index = index
        self.done = threading.Event()


class EmulatedAsyncStream(DeviceStream):
    """An asynchronous device emulated on the CPU: ``launch`` only enqueues the closure; a worker
    thread runs the closures in launch order, each under ``torch.inference_mode`` and followed by
    ``op_delay`` seconds of emulated execution, then marks it complete.

    For tests: ``launched`` and ``completed`` count operators; ``started_at[i]`` and
    ``completed_at[i]`` are the ``time.perf_counter()`` instants operator ``i`` (0-based, in
    launch order over the stream's life) began and finished on the device; ``on_complete(i)``, when
    set, is called on the worker thread right after operator ``i`` ran and before it is marked
    complete (a test sets a stop signal there: the signal then arrives exactly at an operator
    boundary of the device). An exception in an operator is re-raised by the next ``wait``."""

    asynchronous = True

    def __init__(self, op_delay: float = 0.0) -> None:
        self.op_delay = op_delay
        self.on_complete: Callable[[int], None] | None = None
        self.launched = 0
        self.completed = 0
        self.started_at: list[float] = []
        self.completed_at: list[float] = []
        self._last: _Marker | None = None
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="emulated-device", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, marker = item
            self.started_at.append(time.perf_counter())
            if self._error is None:
                try:
                    with torch.inference_mode():
                        op()
                except BaseException as exc:   # surfaced on the host by wait()
                    self._error = exc
            if self.op_delay:
                time.sleep(self.op_delay)
            if self.on_complete is not None:
                self.on_complete(marker.index)
            self.completed_at.append(time.perf_counter())
            self.completed += 1
            marker.done.set()

    def launch(self, op: Callable[[], Any]) -> None:
        marker = _Marker(self.launched)
        self.launched += 1
        self._last = marker
        self._queue.put((op, marker))

    def record(self) -> _Marker | None:
        return self._last

    def query(self, marker: _Marker | None) -> bool:
        return marker is None or marker.done.is_set()

    def wait(self, marker: _Marker | None) -> None:
        if marker is not None:
            marker.done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def synchronize(self) -> None:
        self.wait(self._last)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()


def make_device_stream(device: torch.device | str) -> DeviceStream:
    """The stream of ``device``: CUDA events on CUDA, the host stream elsewhere."""
    device = torch.device(device)
    return CudaStream(device) if device.type == "cuda" else HostStream()


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: on CUDA copied from page-locked memory without blocking the
    host (stream-ordered before every kernel launched after it; the pinned block is not reused
    before the copy finished); elsewhere ``host.to(device)`` (the tensor itself on the CPU). Every
    host-to-device copy of a step goes through here."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_packed(hosts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Several 1-D host tensors of one dtype on ``device`` in a single copy: concatenated, uploaded
    (:func:`upload`), then split into views of the device copy."""
    if len(hosts) == 1:
        return [upload(hosts[0], device)]
    packed = upload(torch.cat(hosts), device)
    return list(packed.split([t.shape[0] for t in hosts]))


def copy_in(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Refill the device tensor ``dst`` in place from ``host`` (pinned and non-blocking on CUDA)."""
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)
