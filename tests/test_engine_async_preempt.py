"""Preemption on an asynchronous device: the stop check of a preemptible step observes *completed*
operators, so a stop is acknowledged within ``preempt_max_inflight`` operators of the device's
execution; without the wait (``preempt_max_inflight=0``) the host runs ahead and the stop lands
only after the launched work drained.

The device is :class:`~laneserve.engine.device_stream.EmulatedAsyncStream`: a worker thread runs
the launched operators later than their launch (each followed by an emulated execution delay).
The stop signal is raised by the device itself when it finishes a given operator, and the tests
count operators the device ran after it: behaviour, not wall-clock."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from engine_support import Driver, make_executor, make_request, prompts
from laneserve.costmodel.base import LAYER_OPERATORS
from laneserve.engine.config import EngineConfig
from laneserve.engine.device_stream import CudaStream, EmulatedAsyncStream, HostStream, make_device_stream

FAMILY = "qwen3"
OP_DELAY = 0.03          # emulated device time per operator; the host launches in microseconds


def _executor(max_inflight: int, delay: float = OP_DELAY):
    ex = make_executor(FAMILY)
    ex.config = dataclasses.replace(ex.config, preempt_max_inflight=max_inflight)
    ex.stream = EmulatedAsyncStream(delay)
    return ex


def _request():
    return make_request(0, prompts([21], seed=3)[0], 2, logprobs=3)


def _reference():
    ex = make_executor(FAMILY)
    _plan, result = Driver(ex).step([(_request(), 21)], [], preemptible=True)
    return result


class _Signal:
    """A stop signal raised by the device when it completes operator ``after`` (1-based)."""

    def __init__(self, stream: EmulatedAsyncStream, after: int) -> None:
        self.after = after
        self.flag = threading.Event()
        self.completed_at_signal: int | None = None
        base = stream.completed

        def on_complete(index: int) -> None:
            if index + 1 - base == after and not self.flag.is_set():
                self.completed_at_signal = stream.completed + 1    # this operator included
                self.flag.set()

        stream.on_complete = on_complete

    def __call__(self) -> bool:
        return self.flag.is_set()


@pytest.mark.parametrize("max_inflight", [1, 2])
@pytest.mark.parametrize("granularity", ["operator", "layer"])
def test_stop_acknowledged_within_the_bound(max_inflight, granularity):
    ref = _reference()
    ex = _executor(max_inflight)
    stream = ex.stream
    total = ex.num_operators
    driver = Driver(ex)
    req = _request()
    after = 3
    signal = _Signal(stream, after)
    plan, first = driver.step([(req, 21)], [], preemptible=True, granularity=granularity, should_stop=signal)
    assert signal.flag.is_set() and not first.completed
    # acknowledged with the device idle: nothing launched is still queued or running
    assert stream.completed == stream.launched == plan.ops_done
    ran_after_signal = stream.completed - signal.completed_at_signal
    # operator granularity: at most max_inflight - 1 operators ran after the signal (one already
    # queued behind the one that just finished); layer granularity: up to the layer's end as well
    span = 1 if granularity == "operator" else len(LAYER_OPERATORS)
    assert 0 <= ran_after_signal <= max_inflight - 1 + span - 1
    if granularity == "layer":
        assert plan.ops_done % len(LAYER_OPERATORS) == 0
    assert plan.ops_done < total and ex.parked_plan_ids == [plan.plan_id]
    stream.on_complete = None
    _plan, resumed = driver.step([], [], plan=plan)
    assert resumed.completed and plan.ops_done == total
    assert resumed.sampled == ref.sampled and resumed.logprobs == ref.logprobs
    stream.close()


def test_without_the_wait_the_host_runs_ahead_and_the_stop_comes_late():
    """``preempt_max_inflight=0`` (no wait): every stop check runs at launch time, before the
    device got far, so the signal raised at operator 5 is never seen and the device runs the whole
    step. This is the failure the bound exists to prevent."""
    ref = _reference()
    ex = _executor(0)
    stream = ex.stream
    total = ex.num_operators
    req = _request()
    signal = _Signal(stream, 5)          # 5 x OP_DELAY after the launches: the host is long done
    plan, result = Driver(ex).step([(req, 21)], [], preemptible=True, should_stop=signal)
    assert signal.flag.is_set()
    assert result.completed and plan.ops_done == total              # the stop never landed
    assert stream.completed - signal.completed_at_signal > 1        # far beyond the bound
    assert result.sampled == ref.sampled
    stream.close()


def test_non_preemptible_steps_do_not_wait_per_operator():
    """A step that cannot stop launches every operator back to back: the host waits only for the
    logits (one wait per step), whatever ``preempt_max_inflight`` is."""
    ref = _reference()
    ex = _executor(1, delay=0.0)
    stream = ex.stream
    waits = []
    real_wait = stream.wait

    def counting_wait(marker):
        waits.append(marker)
        real_wait(marker)

    stream.wait = counting_wait
    _plan, result = Driver(ex).step([(_request(), 21)], [])
    assert result.completed and result.sampled == ref.sampled
    assert len(waits) <= 1
    stream.close()


def test_host_stream_is_the_cpu_default_and_config_validates():
    ex = make_executor(FAMILY)
    assert isinstance(ex.stream, HostStream) and not ex.stream.asynchronous
    assert isinstance(make_device_stream("cpu"), HostStream)
    cuda = make_device_stream("cuda:0")                  # built without touching a device
    assert isinstance(cuda, CudaStream) and cuda.asynchronous
    assert EngineConfig().preempt_max_inflight == 1
    with pytest.raises(ValueError):
        EngineConfig(preempt_max_inflight=-1)


def test_emulated_device_surfaces_operator_errors():
    stream = EmulatedAsyncStream()

    def boom():
        raise RuntimeError("kernel failed")

    stream.launch(boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        stream.wait(stream.record())
    stream.close()
