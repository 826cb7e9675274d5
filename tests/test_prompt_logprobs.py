"""Prompt logprobs (``SamplingParams.prompt_logprobs``; the API's ``echo`` with ``logprobs`` and
vLLM's ``prompt_logprobs``): the prefill keeps the logits of every prompt position it computes and
records each prompt token's logprob under the raw model distribution, equal to HF's, whether the
prompt runs in one step or in chunks, and a prefix-cached prompt is recomputed to get them."""

from __future__ import annotations

import pytest
import torch

from engine_support import hf_logits, prompts, tiny_checkpoint
from laneserve.core import SamplingParams
from laneserve.engine import EngineConfig
from laneserve.engine.llm import LLM

FAMILY = "qwen2"


def _hf_prompt_logprobs(tokens: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    lp = torch.log_softmax(hf_logits(FAMILY, tokens).float(), dim=-1)
    chosen = [float(lp[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]
    tops = [torch.topk(lp[i], k).indices.tolist() for i in range(len(tokens) - 1)]
    return chosen, tops


@pytest.mark.parametrize("policy", ["colocated:prefill=fcfs", "colocated:prefill=cp-edf,chunk=16"])
def test_prompt_logprobs_equal_hf_in_one_step_and_in_chunks(policy):
    llm = LLM(tiny_checkpoint(FAMILY), config=EngineConfig(num_kv_blocks=64, block_size=8, num_threads=1),
              policy=policy, quiet=True)
    ps = prompts([37, 5, 50], seed=11)
    reqs = [llm._make_request(list(p), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                     prompt_logprobs=3)) for p in ps]
    for r in reqs:
        llm.instance.submit(r)
    llm.instance.run_until_idle()
    for p, r in zip(ps, reqs):
        chosen, tops = _hf_prompt_logprobs(list(p), 3)
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(p) - 1
        got = [e[0] for e in r.prompt_logprobs]
        assert got == pytest.approx(chosen, abs=1e-4)
        assert [[t for t, _ in e[1]] for e in r.prompt_logprobs] == tops


def test_prompt_logprobs_skip_the_prefix_cache():
    """A prompt whose blocks are cached is still computed whole when its prompt logprobs are asked."""
    llm = LLM(tiny_checkpoint(FAMILY), config=EngineConfig(num_kv_blocks=64, block_size=8, num_threads=1,
                                                           prefix_caching=True), quiet=True)
    p = prompts([40], seed=3)[0]
    first = llm._make_request(list(p), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    llm.instance.submit(first)
    llm.instance.run_until_idle()
    again = llm._make_request(list(p), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                                     prompt_logprobs=0))
    llm.instance.submit(again)
    llm.instance.run_until_idle()
    assert again.num_cached_tokens == 0
    chosen, _ = _hf_prompt_logprobs(list(p), 1)
    assert [e[0] for e in again.prompt_logprobs] == pytest.approx(chosen, abs=1e-4)
    assert all(e[1] == [] for e in again.prompt_logprobs)
