"""``laneserve serve --colocated -tp 2``: the instance worker hosts a two-rank group and answers
greedily as the same model on one rank; ``/debug/state`` and ``/metrics`` show the degree and the
rank processes; stopping the server leaves no rank process. A TP2 prefill instance hands its
sharded KV to a TP1 decode instance (different degrees per role) and the answer is the same."""

from __future__ import annotations

import argparse
import os

import httpx
import pytest

from laneserve.commands.vllm_flags import _tensor_parallel_sizes
from laneserve.core.sampling import SamplingParams
from laneserve.engine.llm import LLM
from server_support import TIMEOUT, serving, wait_for

PROMPT = "The quick brown fox"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_colocated_tp2_server_answers_as_one_rank_and_shows_its_ranks():
    ref = LLM(quiet=True).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    with serving("--colocated", "-tp", "2") as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        inst = httpx.get(s.url + "/debug/state", timeout=TIMEOUT).json()["instances"][0]
        assert inst["tensor_parallel_size"] == 2 and len(inst["rank_pids"]) == 1
        ranks = inst["rank_pids"]
        assert all(_alive(p) for p in ranks)
        metrics = httpx.get(s.url + "/metrics", timeout=TIMEOUT).text
        assert any(line.startswith("laneserve:tensor_parallel_size{") and line.endswith(" 2.0")
                   for line in metrics.splitlines()), metrics
    wait_for(lambda: not any(_alive(p) for p in ranks), 20, "the rank processes to exit")


def _args(**kw) -> argparse.Namespace:
    base = dict(tensor_parallel_size=1, prefill_tensor_parallel_size=None, decode_tensor_parallel_size=None,
                colocated=False, stub=False)
    return argparse.Namespace(**{**base, **kw})


def test_degrees_per_role_resolve_and_what_cannot_run_is_refused():
    a = _args(tensor_parallel_size=2, colocated=True)
    _tensor_parallel_sizes(a)
    assert (a.prefill_tensor_parallel_size, a.decode_tensor_parallel_size) == (2, 2)
    a = _args()
    _tensor_parallel_sizes(a)
    assert (a.prefill_tensor_parallel_size, a.decode_tensor_parallel_size) == (1, 1)
    a = _args(prefill_tensor_parallel_size=2)
    _tensor_parallel_sizes(a)
    assert (a.prefill_tensor_parallel_size, a.decode_tensor_parallel_size) == (2, 1)
    with pytest.raises(ValueError, match="per-role"):
        _tensor_parallel_sizes(_args(colocated=True, decode_tensor_parallel_size=2))


def test_tp2_prefill_hands_its_kv_to_a_tp1_decode_instance():
    ref = LLM(quiet=True).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    with serving("--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", "2") as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        state = httpx.get(s.url + "/debug/state", timeout=TIMEOUT).json()
        assert {i["role"]: i["tensor_parallel_size"] for i in state["instances"]} == {"prefill": 2, "decode": 1}
        assert state["kv_files"] == 0                     # every shard's file was consumed
