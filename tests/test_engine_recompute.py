"""Recompute after preemption (vLLM-style, ``policies/decode/base.py`` ``_readmit_parked``): a
decoding request's KV is dropped, later re-prefilled over prompt + all outputs but the newest
(``PrefillChunk(req, 0, context_len - 1)``), and decoding continues with tokens identical to an
uninterrupted greedy run. The recompute chunk samples nothing (runner.py)."""

from __future__ import annotations

import pytest

from engine_support import Driver, make_executor, make_request, prompts
from laneserve.core.plan import PrefillChunk, StepPlan

FAMILY = "llama"
PROMPT_LEN, MAX_TOKENS, DECODED_BEFORE_DROP = 20, 10, 5


def _reference(attention: str) -> list[int]:
    req = make_request(0, prompts([PROMPT_LEN], seed=11)[0], MAX_TOKENS)
    return Driver(make_executor(FAMILY, attention)).run([req])[0]


def _drop_kv(driver: Driver, req) -> None:
    """Free the request's blocks and overwrite them with another request's KV (the free list is
    LIFO, so the next allocation reuses them): stale KV cannot leak into the recompute."""
    kv = driver.ex.kv
    kv.free(req.request_id)
    req.num_computed_tokens = 0
    intruder = make_request(99, prompts([req.context_len], seed=12)[0], 1)
    driver.step([(intruder, intruder.prompt_len)], [])
    kv.free(intruder.request_id)


def _recompute_step(driver: Driver, req, start: int, end: int, decodes=()):
    kv = driver.ex.kv
    kv.allocate(req.request_id, req.context_len)
    for other in decodes:
        kv.allocate(other.request_id, other.context_len)
    plan = StepPlan(prefills=[PrefillChunk(req, start, end - start)], decodes=list(decodes))
    return driver.step([], [], plan=plan)[1]


@pytest.mark.parametrize("attention", ["ragged", "padded"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_recompute_then_decode_matches_uninterrupted(attention, chunk):
    ref = _reference(attention)
    driver = Driver(make_executor(FAMILY, attention))
    req = make_request(0, prompts([PROMPT_LEN], seed=11)[0], MAX_TOKENS)
    # a second request decodes alongside, including in the recompute step
    other = make_request(1, prompts([9], seed=13)[0], MAX_TOKENS)
    driver.step([(req, PROMPT_LEN), (other, 9)], [])
    while req.num_output_tokens < DECODED_BEFORE_DROP:
        driver.step([], [req, other])
    _drop_kv(driver, req)
    target = req.context_len - 1            # everything but the newest output token
    bounds = list(range(0, target, chunk or target)) + [target]   # chunk 7: [14, 21) crosses the prompt end
    for start, end in zip(bounds, bounds[1:]):
        result = _recompute_step(driver, req, start, end, decodes=[other])
        assert req.request_id not in result.sampled          # a recompute chunk returns no token
        assert other.request_id in result.sampled
    assert req.num_computed_tokens == target and req.num_output_tokens == DECODED_BEFORE_DROP
    while req.num_output_tokens < MAX_TOKENS:
        driver.step([], [req])
    assert req.output_token_ids == ref


def test_recompute_through_newest_token_samples_the_next():
    """A chunk that also covers the newest output token reaches the end of the known tokens, so
    it samples — the same token the next decode would have produced."""
    ref = _reference("ragged")
    driver = Driver(make_executor(FAMILY, "ragged"))
    req = make_request(0, prompts([PROMPT_LEN], seed=11)[0], MAX_TOKENS)
    driver.step([(req, PROMPT_LEN)], [])
    while req.num_output_tokens < DECODED_BEFORE_DROP:
        driver.step([], [req])
    _drop_kv(driver, req)
    kv = driver.ex.kv
    kv.allocate(req.request_id, req.context_len)
    plan = StepPlan(prefills=[PrefillChunk(req, 0, req.context_len)])
    result = driver.ex.execute(plan)
    assert result.sampled == {req.request_id: ref[DECODED_BEFORE_DROP]}


def test_chunk_beyond_known_tokens_is_rejected():
    driver = Driver(make_executor(FAMILY, "ragged"))
    req = make_request(0, prompts([PROMPT_LEN], seed=11)[0], MAX_TOKENS)
    driver.step([(req, PROMPT_LEN)], [])
    driver.ex.kv.allocate(req.request_id, req.context_len + 4)
    with pytest.raises(ValueError, match="outside its"):
        driver.ex.execute(StepPlan(prefills=[PrefillChunk(req, 0, req.context_len + 1)]))
