"""Resumable prefill (FlowPrefill §4 operator-level preemption): stopping at any operator boundary
and resuming gives identical logits and tokens; layer and chunk granularities; plans are parked
per ``plan_id`` and other plans may run in between."""

from __future__ import annotations

import pytest

from engine_support import Driver, make_executor, make_request, prompts
from laneserve.costmodel.base import LAYER_OPERATORS

FAMILY = "qwen3"


def _stop_at(k: int):
    """A ``should_stop`` that says yes on its k-th call (1-based) only."""
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return calls[0] == k

    return should_stop, calls


def _batch(seed: int = 5):
    """A prefill of two chunks, one on top of 9 cached tokens (gathers) and one fresh."""
    a, b = prompts([20, 13], seed=seed)
    ra, rb = make_request(0, a, 3, logprobs=5), make_request(1, b, 3, logprobs=5)
    return ra, rb


def _reference(attention: str):
    ex = make_executor(FAMILY, attention)
    driver = Driver(ex)
    ra, rb = _batch()
    driver.step([(ra, 9)], [])
    _plan, result = driver.step([(ra, 11), (rb, 13)], [], preemptible=True)
    return result


@pytest.mark.parametrize("attention", ["ragged", "padded"])
def test_preempt_at_every_operator_boundary_then_resume(attention):
    ref = _reference(attention)
    ex0 = make_executor(FAMILY, attention)
    total = ex0.num_operators
    assert total == 2 * len(LAYER_OPERATORS)
    for k in range(1, total):
        ex = make_executor(FAMILY, attention)
        driver = Driver(ex)
        ra, rb = _batch()
        driver.step([(ra, 9)], [])
        stop, calls = _stop_at(k)
        plan, first = driver.step([(ra, 11), (rb, 13)], [], preemptible=True, should_stop=stop)
        assert not first.completed and plan.ops_done == k and calls[0] == k
        assert ex.parked_plan_ids == [plan.plan_id]
        assert ra.num_computed_tokens == 9 and rb.num_computed_tokens == 0   # counters untouched
        # another (urgent) request runs while the plan is parked
        urgent = make_request(7, prompts([17], seed=99)[0], 1)
        Driver(ex).step([(urgent, 17)], [])
        _plan, resumed = driver.step([], [], plan=plan)
        assert resumed.completed and plan.ops_done == total and len(plan.op_times) == total
        assert resumed.sampled == ref.sampled
        for rid in resumed.sampled:
            assert resumed.logprobs[rid] == ref.logprobs[rid]
        assert not ex.parked_plan_ids


def test_repeated_preemption_layer_granularity():
    ref = _reference("ragged")
    ex = make_executor(FAMILY, "ragged")
    driver = Driver(ex)
    ra, rb = _batch()
    driver.step([(ra, 9)], [])
    plan, result = driver.step([(ra, 11), (rb, 13)], [], preemptible=True, granularity="layer",
                               should_stop=lambda: True)
    assert not result.completed and plan.ops_done == len(LAYER_OPERATORS)
    _plan, result = driver.step([], [], plan=plan, should_stop=lambda: True)   # no boundary left
    assert result.completed and result.sampled == ref.sampled


def test_chunk_granularity_never_stops_inside_a_step():
    ex = make_executor(FAMILY)
    driver = Driver(ex)
    ra, rb = _batch()
    stop, calls = _stop_at(1)
    plan, result = driver.step([(ra, 20), (rb, 13)], [], preemptible=True, granularity="chunk", should_stop=stop)
    assert result.completed and calls[0] == 0 and plan.ops_done == ex.num_operators


def test_discard_parked_plan():
    ex = make_executor(FAMILY)
    driver = Driver(ex)
    ra, _ = _batch()
    plan, result = driver.step([(ra, 20)], [], preemptible=True, should_stop=lambda: True)
    assert not result.completed and ex.discard(plan) and not ex.parked_plan_ids
    with pytest.raises(ValueError):
        ex.execute(plan)
