"""Hostile requests and vLLM client parity, round four, against the session's live 1P+1D server
(smoke model): endpoints that tokenize or render are held to the prompt's budget before the work,
constraints are proven before admission (a 400 naming the field, never an instance's 500),
contradictory sampling constraints are refused, duplicate tool names are refused, and what real
clients see matches vLLM's answer: a named or "required" tool call cut by ``max_tokens``, object
schemas closed by default, ``echo`` with ``max_tokens: 0``, an empty ``stream_options`` and
integer ``rank`` in ``prompt_logprobs``."""

from __future__ import annotations

import json

import httpx
import pytest

from server_support import TIMEOUT, WEATHER_TOOLS, wait_all_free

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# a tool whose arguments are a tree: its schema refers to itself through $defs
TREE_TOOL = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
    "additionalProperties": False,
    "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2,
                                                                "items": {"$ref": "#/$defs/node"}}},
                       "required": ["kids"], "additionalProperties": False}}}}}


@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    yield srv
    wait_all_free(srv)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def _chat(server, **fields) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 16, **fields})


def _refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param, err
    for word in words:
        assert word in err["message"], err


# ---- size limits before the work -----------------------------------------------------------------
def test_tokenize_and_tools_are_held_to_the_prompt_budget(server):
    max_len = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]
    huge = "word " * (max_len * 64 // 5 + 10)                # more characters than the context can hold
    _refused(_post(server, "/tokenize", {"prompt": huge}), "prompt", "characters")
    big_tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 20_000,
                                                   "parameters": {"type": "object"}}} for i in range(16)]
    _refused(_post(server, "/tokenize", {"messages": USER, "tools": big_tools}), "tools", "characters")
    _refused(_chat(server, tools=big_tools, tool_choice="none"), "tools", "characters")
    _refused(_post(server, "/detokenize", {"tokens": [1] * (max_len + 1)}), "tokens", "context")
    ok = _post(server, "/tokenize", {"prompt": "hello world"})
    assert ok.status_code == 200 and ok.json()["count"] >= 2


def test_duplicate_tool_names_are_refused(server):
    twice = [WEATHER_TOOLS[0], WEATHER_TOOLS[1], WEATHER_TOOLS[0]]
    _refused(_chat(server, tools=twice, tool_choice="required"), "tools", "get_weather", "twice")
    _refused(_post(server, "/tokenize", {"messages": USER, "tools": twice}), "tools", "twice")


def test_head_version_is_answered(server):
    r = httpx.head(server.url + "/version", timeout=TIMEOUT)
    assert r.status_code == 200


# ---- constraints proven before admission ---------------------------------------------------------
@pytest.mark.parametrize("fields,param,word", [
    ({"guided_json": {"$ref": "#"}}, "guided_json", "refers to itself"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "guided_json", "refers to itself"),
    ({"guided_grammar": 'start: "a"{1000000}'}, "guided_grammar", "budget"),
    ({"guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(5000))}, "guided_grammar", "budget"),
    ({"guided_grammar": "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1}" for i in range(60)) + '\nr60: "a"'},
     "guided_grammar", "budget"),
    ({"allowed_token_ids": ["EOS"], "min_tokens": 3}, "allowed_token_ids", "min_tokens"),
    ({"allowed_token_ids": [5, 6], "guided_regex": "[0-9]+"}, "allowed_token_ids", "structured-output"),
], ids=["ref_root", "ref_cycle", "a_1e6", "gbnf_5000", "doubling_chain", "eos_min_tokens", "allowed_vs_regex"])
def test_constraints_that_cannot_run_are_400s(server, fields, param, word):
    if fields.get("allowed_token_ids") == ["EOS"]:
        (eos,) = _post(server, "/tokenize", {"prompt": "</s>", "add_special_tokens": False}).json()["tokens"]
        fields = {**fields, "allowed_token_ids": [eos]}
    r = _chat(server, **fields)
    _refused(r, param, word)


def test_bad_words_against_a_regex_is_a_400(server):
    ids = _post(server, "/tokenize", {"prompt": "7", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    _refused(_chat(server, guided_regex="7", bad_words=["7"]), "bad_words", "structured-output")


# ---- tool calls ----------------------------------------------------------------------------------
def test_recursive_defs_work_under_tool_choice_required(server):
    r = _chat(server, tools=[TREE_TOOL, WEATHER_TOOLS[1]], tool_choice="required", max_tokens=200, seed=1)
    assert r.status_code == 200, r.text[:300]
    msg = r.json()["choices"][0]["message"]
    if r.json()["choices"][0]["finish_reason"] == "tool_calls":
        for call in msg["tool_calls"]:
            assert call["function"]["name"] in ("plant", "ping")
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_cut_off_tool_calls_come_back_as_vllm_sends_them(server):
    client = server.client()
    named = client.chat.completions.create(
        model=MODEL, messages=USER, tools=WEATHER_TOOLS, max_tokens=3, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments.startswith("{") and named.usage.completion_tokens == 3

    required = client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER_TOOLS, max_tokens=3,
                                              tool_choice="required", seed=3)
    choice = required.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert not choice.message.tool_calls


# ---- vLLM parity the clients notice --------------------------------------------------------------
def test_object_schemas_are_closed_by_default(server):
    client = server.client()
    # pydantic's model_json_schema() shape: no additionalProperties
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "title": "Person"}
    out = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=60, n=4, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}})
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert set(json.loads(choice.message.content)) == {"name", "age"}, choice.message.content
    # a closed object with one property cannot have two: provably nothing to generate (open, it could)
    two = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2}
    r = _chat(server, guided_json=two, max_tokens=40)
    assert r.status_code == 400, r.text[:300]


def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(server):
    client = server.client()
    prompt = "the quick brown fox jumps"
    n_prompt = len(_post(server, "/tokenize", {"prompt": prompt}).json()["tokens"])
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == n_prompt
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt and lp.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    with pytest.raises(openai.BadRequestError):          # without echo, 0 tokens is still refused
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    for logprobs in (None, 1):                            # streamed: the same text, the same logprobs
        text, tokens = "", []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0,
                                               logprobs=logprobs, stream=True):
            for c in chunk.choices:
                text += c.text
                tokens += c.logprobs.tokens if c.logprobs else []
        assert text == prompt
        assert tokens == (lp.tokens if logprobs else [])


def test_empty_stream_options_without_stream_is_accepted(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, stream_options={})
    assert out.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError):          # a real option still needs stream: true
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       stream_options={"include_usage": True})


def test_prompt_logprobs_ranks_are_integers(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "the cat sat on the mat", "max_tokens": 1,
                                          "prompt_logprobs": 2})
    assert r.status_code == 200, r.text[:300]
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 3
    for entry in entries[1:]:
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert all(isinstance(e["rank"], int) and e["rank"] >= 1 for e in ranked), entry
        # a rank counts the tokens more likely than it: the larger logprob, the smaller rank
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
