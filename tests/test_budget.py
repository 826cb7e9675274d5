"""The per-request budget (laneserve.server.budget): shares of slots and KV, and the response cap."""

from __future__ import annotations

import pytest

from laneserve.server.budget import OverBudget, RequestBudget, check, response_bytes

ARGS = dict(max_inflight=256, decode_kv_tokens=65536, instance_kv_tokens=65536)


def run(budget=RequestBudget(), **kw):
    base = dict(prompt_lens=[100], samples=1, returned=1, max_tokens=100, logprobs=None, prompt_logprobs=None,
                echo=False, **ARGS)
    return check(budget, **{**base, **kw})


def test_slot_share_counts_prompts_times_samples():
    run(prompt_lens=[10] * 8, samples=8, max_tokens=10)                  # 64 sequences: exactly the share
    with pytest.raises(OverBudget, match="64 of the 256") as e:
        run(prompt_lens=[10, 10], samples=128, max_tokens=10)
    assert e.value.param == "best_of"
    with pytest.raises(OverBudget) as e:
        run(prompt_lens=[10] * 65, samples=1, max_tokens=10)
    assert e.value.param == "prompt"
    run(RequestBudget(max_request_share=1.0), prompt_lens=[10, 10], samples=128, max_tokens=10)


def test_kv_share_but_one_sequence_may_fill_an_instance():
    run(prompt_lens=[1000], max_tokens=40000)                            # one sequence: up to an instance
    with pytest.raises(OverBudget, match="KV") as e:
        run(prompt_lens=[100], samples=8, max_tokens=3000)               # 24,100 > a quarter of 65,536
    assert e.value.param == "max_tokens"


def test_response_cap_names_the_field_that_amplifies():
    small = RequestBudget(max_response_bytes=1 << 20)
    run(small, prompt_lens=[200], echo=True, logprobs=5, max_tokens=50)
    with pytest.raises(OverBudget, match="--max-response-bytes") as e:
        run(small, prompt_lens=[4000] * 4, echo=True, logprobs=20, prompt_logprobs=20, max_tokens=16)
    assert e.value.param == "prompt_logprobs"
    assert response_bytes([4000] * 40, 1, 16, 20, 20, True) > 64 << 20     # the hostile case of the issue
    assert response_bytes([100], 1, 16, None, None, False) < 4096


def test_budget_options_are_checked():
    for bad in (dict(max_request_share=0), dict(max_request_share=1.5), dict(max_response_bytes=10)):
        with pytest.raises(ValueError):
            RequestBudget(**bad)
