"""Structured output and several samples in ``--colocated`` mode, with the
official ``openai`` client against one live colocated server of the smoke model: a ``json_schema``
response parses and validates every time (only a working constraint can do that with noise
weights), and ``n`` samples fork the prompt's KV on the one instance (greedy samples identical to
n=1; seeded ones identical to those of the 1P+1D server, checked through the derived seeds)."""

from __future__ import annotations

import json

import pytest
from server_support import TIMEOUT, wait_all_free
from test_server_openai import _PERSON, _check

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
PROMPT = "serve the model token serve the model token prefill decode serve"


@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--colocated", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    return srv


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_output_validates_in_colocated_mode(server, seed):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person please"}], temperature=1.0, seed=seed, n=2,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": _PERSON}})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        _check(json.loads(choice.message.content), _PERSON)


def test_n_samples_fork_the_prompt_on_one_instance(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT)

    def tokens(**kw) -> list[list[int]]:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                        extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
        return [c.model_dump()["token_ids"] for c in out.choices]
    one = tokens(temperature=0)
    assert tokens(temperature=0, n=3) == one * 3
    seeded = tokens(temperature=1.0, seed=9, n=3)
    assert seeded == [tokens(temperature=1.0, seed=9 + k)[0] for k in range(3)]
    assert wait_all_free(server)["in_flight"] == 0
