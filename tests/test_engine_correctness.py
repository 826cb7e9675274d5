"""Engine outputs against the reference implementation (transformers) on tiny random Llama, Qwen2
and Qwen3 checkpoints: greedy tokens, logprobs, chunked prefill, mixed steps, prefix reuse and
LAPS shape-bucket padding, for both attention paths (docs/design.md, "AlignedServe")."""

from __future__ import annotations

import pytest
import torch

from laneserve.core.plan import PrefillChunk, StepPlan
from engine_support import Driver, hf_greedy, hf_logits, make_executor, make_request, prompts

FAMILIES = ["llama", "qwen2", "qwen3"]
ATTENTION = ["ragged", "padded"]
MIXED_LENGTHS = [5, 23, 1, 12]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def reference(family):
    """HF greedy continuations of the mixed-length prompts (one unpadded ``generate`` each)."""
    ps = prompts(MIXED_LENGTHS, seed=7)
    return ps, [hf_greedy(family, p, NEW_TOKENS) for p in ps]


@pytest.mark.parametrize("attention", ATTENTION)
def test_single_prompt_matches_hf(family, reference, attention):
    ps, ref = reference
    driver = Driver(make_executor(family, attention))
    out = driver.run([make_request(0, ps[1], NEW_TOKENS)])
    assert out[0] == ref[1]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_batched_chunked_prefill_matches_hf(family, reference, attention, chunk_size):
    ps, ref = reference
    reqs = [make_request(i, p, NEW_TOKENS) for i, p in enumerate(ps)]
    out = Driver(make_executor(family, attention)).run(reqs, chunk_size=chunk_size)
    assert out == ref


@pytest.mark.parametrize("attention", ATTENTION)
def test_mixed_prefill_and_decode_steps(family, reference, attention):
    """Requests arrive one per step; each step holds the newcomer's prefill and everyone's decode."""
    ps, ref = reference
    driver = Driver(make_executor(family, attention))
    reqs = [make_request(i, p, NEW_TOKENS) for i, p in enumerate(ps)]
    waiting = list(reqs)
    while any(r.num_output_tokens < r.max_output_tokens for r in reqs):
        chunks = [(r, r.prompt_len) for r in waiting[:1]]
        del waiting[:1]
        decodes = [r for r in reqs if r.prefill_done and 0 < r.num_output_tokens < r.max_output_tokens]
        driver.step(chunks, decodes)
    assert [r.output_token_ids for r in reqs] == ref


def test_logprobs_match_hf_log_softmax(family):
    p = prompts([11], seed=3)[0]
    ex = make_executor(family)
    req = make_request(0, p, 3, logprobs=5)
    driver = Driver(ex)
    driver.run([req])
    ref = torch.log_softmax(hf_logits(family, p + req.output_token_ids[:-1]), dim=-1)
    for step, lp in enumerate(driver.logprobs[0]):
        row = ref[len(p) - 1 + step]
        top_v, top_i = row.topk(5)
        assert lp.token_id == req.output_token_ids[step]
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_v, atol=1e-4)
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("prefix", [16, 13])
def test_prefix_reuse(family, attention, prefix):
    """A second request whose first ``prefix`` tokens' KV is copied from the first one starts its
    prefill at ``num_computed_tokens = prefix`` and still matches HF on its full prompt."""
    shared, tail_a, tail_b = prompts([prefix, 6, 9], seed=11)
    ex = make_executor(family, attention)
    driver = Driver(ex)
    a = make_request(0, shared + tail_a, 2)
    driver.run([a])
    b = make_request(1, shared + tail_b, NEW_TOKENS)
    ex.kv.allocate(b.request_id, prefix)
    ex.import_kv(b.request_id, ex.export_kv(a.request_id, prefix))
    b.num_computed_tokens = b.num_cached_tokens = prefix
    out = driver.run([b], chunk_size=4)
    assert out[0] == hf_greedy(family, shared + tail_b, NEW_TOKENS)


@pytest.mark.parametrize("attention", ATTENTION)
def test_shape_bucket_padding_does_not_change_tokens(family, reference, attention):
    ps, ref = reference
    ex = make_executor(family, attention)
    driver = Driver(ex)
    reqs = [make_request(i, p, NEW_TOKENS) for i, p in enumerate(ps)]
    _plan, result = driver.step([(r, r.prompt_len) for r in reqs], [])
    assert [result.sampled[r.request_id] for r in reqs] == [x[0] for x in ref]
    # the same prompts as a (32 tokens x 4 sequences) LAPS bucket
    ex2 = make_executor(family, attention)
    reqs2 = [make_request(i, p, NEW_TOKENS) for i, p in enumerate(ps)]
    plan2 = StepPlan(prefills=[PrefillChunk(r, 0, r.prompt_len) for r in reqs2], padded_shape=(32, 4))
    for r in reqs2:
        ex2.kv.allocate(r.request_id, r.prompt_len)
    assert ex2.execute(plan2).sampled == result.sampled
