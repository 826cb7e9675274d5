"""The OpenAI surface vLLM users send, with the official ``openai`` client against one
live 1P+1D server of the smoke model (prefill and decode in separate processes, so every feature
crosses the hand-off): penalties and logit_bias change greedy output exactly as transformers'
processors (or the direct formula) predict on the same checkpoint, min_tokens, max_completion_tokens,
stop lists, per-token logprobs on every path, unknown fields accepted, ``/openapi.json`` describing
the request models, ``/metrics`` through prometheus_client's parser (aborted requests counted),
and the load generator's HTTP client."""

from __future__ import annotations

import asyncio
import functools

import httpx
import pytest
import torch
from engine_support import OutputPenalty
from server_support import TIMEOUT, WEATHER_TOOLS, wait_all_free

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from laneserve.server.schema import ChatCompletionResponse, CompletionResponse  # noqa: E402

MODEL = "smoke-llama"
PROMPT = "serve the model token serve the model token prefill decode serve"
N = 12
# a prompt whose greedy continuation (byte-level smoke tokenizer) every penalty below changes
PENALTY_PROMPT = "hello the world hello the world"


@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    return srv


@functools.cache
def _hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laneserve.engine.smoke import smoke_model_path
    path = smoke_model_path()
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(path)))


def _hf_greedy(prompt_ids: list[int], n: int, processors: list) -> list[int]:
    from transformers import LogitsProcessorList
    model, _ = _hf()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt_ids):].tolist()


def _ids(client, prompt: str = PROMPT, **kw) -> tuple[list[int], list[int]]:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **kw})
    choice = out.model_dump()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def test_penalties_match_transformers_across_the_handoff(server):
    from transformers import RepetitionPenaltyLogitsProcessor
    client = server.client()
    prompt, plain = _ids(client, PENALTY_PROMPT)
    assert plain == _hf_greedy(prompt, N, [])
    changed = 0
    for kw, proc in (({"repetition_penalty": 1.8}, RepetitionPenaltyLogitsProcessor(1.8)),
                     ({"presence_penalty": 2.0}, OutputPenalty(len(prompt), 2.0, 0.0)),
                     ({"frequency_penalty": 1.5, "presence_penalty": -0.5}, OutputPenalty(len(prompt), -0.5, 1.5))):
        _, got = _ids(client, PENALTY_PROMPT, **kw)
        assert got == _hf_greedy(prompt, N, [proc]), kw
        changed += got != plain
    assert changed >= 2, "penalties did not change the greedy output: the comparison proves nothing"


def test_logit_bias_forces_and_bans_tokens(server):
    client = server.client()
    _, plain = _ids(client)
    forced = 300
    _, got = _ids(client, logit_bias={str(forced): 100})
    assert got == [forced] * N
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                          temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.model_dump()["choices"][0]["token_ids"] == [forced] * 5
    _, banned = _ids(client, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"99999": 5})


def test_min_tokens_holds_back_eos(server):
    client = server.client()
    _, tok = _hf()
    eos = str(tok.eos_token_id)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    early = client.completions.create(**body, logit_bias={eos: 100})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    held = client.completions.create(**body, logit_bias={eos: 100}, extra_body={"min_tokens": 4,
                                                                                "return_token_ids": True})
    ids = held.model_dump()["choices"][0]["token_ids"]
    assert held.choices[0].finish_reason == "stop" and len(ids) == 5 and ids[-1] == int(eos)
    assert int(eos) not in ids[:4]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(**body, extra_body={"min_tokens": 11})


def test_max_completion_tokens_and_stop_lists(server):
    client = server.client()
    msgs = [{"role": "user", "content": "serve the model"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=7, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 7 and chat.choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]          # the smoke model's text is noise without spaces
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                    stop=["never-in-the-vocabulary", stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]


def test_logprobs_on_every_path(server):
    """One entry per output token — the prefill instance's first token and the decode instance's
    others — for completions and chat, streamed and not."""
    client = server.client()
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    comp = client.completions.create(prompt=PROMPT, logprobs=2, **kw)
    CompletionResponse.model_validate(comp.model_dump())
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = list(client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **kw))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **kw)
    ChatCompletionResponse.model_validate(chat.model_dump())
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    chunks = list(client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, stream=True, **kw))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content])


def test_unknown_fields_are_accepted(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                    extra_body={"guided_choice_typo": ["a"], "some_future_field": {"x": 1}})
    assert out.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"another_unknown": True})
    assert chat.choices[0].message.role == "assistant"


def test_openapi_describes_the_request_models(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=5).json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "400" in spec["paths"][path]["post"]["responses"]
    comp, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    for name in ("prompt", "max_tokens", "temperature", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "min_tokens", "stop", "logprobs", "slo"):
        assert name in comp, name
    for name in ("messages", "max_completion_tokens", "top_logprobs", "logit_bias"):
        assert name in chat, name
    assert set(schemas["CompletionRequest"]["required"]) == {"prompt"}      # model is optional, as in vLLM
    assert "CompletionResponse" in schemas and "ChatMessage" in schemas
    assert httpx.get(server.url + "/docs", timeout=5).status_code == 200


def _samples(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_parse_and_count_aborts(server):
    model = (("model_name", MODEL),)
    before = _samples(server)
    names = {name for name, _ in before}
    for name in ("laneserve:time_to_first_token_seconds_bucket", "laneserve:inter_token_latency_seconds_count",
                 "laneserve:request_time_per_output_token_seconds_sum", "laneserve:e2e_request_latency_seconds_count",
                 "laneserve:request_queue_time_seconds_count", "laneserve:request_success_total",
                 "laneserve:prompt_tokens_total", "laneserve:generation_tokens_total", "laneserve:num_requests_running",
                 "laneserve:num_requests_waiting", "laneserve:kv_cache_usage_perc", "laneserve:kv_cache_free_blocks",
                 "laneserve:kv_cache_total_blocks", "laneserve:instance_up", "laneserve:num_preemptions_total",
                 "laneserve:num_requests_in_flight", "laneserve:request_aborted_total"):
        assert name in names, name
    assert {labels for name, labels in before if name == "laneserve:instance_up"} == {
        (("engine", i), ("model_name", MODEL), ("role", r)) for i, r in (("0", "prefill"), ("1", "decode"))}
    body = {"model": MODEL, "prompt": list(range(30, 130)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert any(ln.startswith("data: ") for ln in (next(lines) for _ in range(4)))
    wait_all_free(server)          # the stream was cut mid-way: aborted, KV freed
    after = _samples(server)
    key = ("laneserve:request_aborted_total", model)
    assert after[key] == before[key] + 1


def test_load_generator_over_httpx(server):
    from laneserve.bench.loadgen import LoadConfig, bench_summary, run_load
    from laneserve.core import SLO, RequestSpec
    specs = [RequestSpec(i, 0.05 * i, 16, 4, slo=SLO(5.0, 1.0)) for i in range(4)]
    result = asyncio.run(run_load(LoadConfig(base_url=server.url, progress=False), specs, rate=float("inf")))
    s = bench_summary(result)
    assert s["completed"] == 4 and s["failed"] == 0 and s["output_lens"] == [4, 4, 4, 4]


# ---- structured output: the prefill instance constrains the first token, the
# decode instance replays it and continues; random weights, so only the constraint makes JSON
_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "mood": {"enum": ["calm", "busy", "odd"]},
    "active": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "mood", "active", "tags"], "additionalProperties": False}


def _check(value, schema: dict) -> None:
    """The subset of JSON Schema used above."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(value) == set(schema["required"])
        for k, v in value.items():
            _check(v, schema["properties"][k])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"]
        for v in value:
            _check(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema["maxLength"]
    elif kind == "boolean":
        assert isinstance(value, bool)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_json_schema_output_parses_and_validates_every_time(server, seed):
    import json
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person please"}], temperature=1.0, seed=seed,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": _PERSON}})
    assert out.choices[0].finish_reason == "stop"
    _check(json.loads(out.choices[0].message.content), _PERSON)


def test_vllm_guided_fields_constrain_completions(server):
    import re
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=7,
                                    extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", out.choices[0].text)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=7,
                                    extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].text in ("left", "right")


def test_named_and_required_tool_calls(server):
    import json
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT)
    tools = WEATHER_TOOLS
    msgs = [{"role": "user", "content": "weather?"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=1.0, seed=3,
                                         max_tokens=120,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = out.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 10
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=1.0, seed=5,
                                         max_tokens=200, tool_choice="required", parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls"
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "ping")
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_unsupported_and_hostile_structured_specs_are_400_and_the_server_lives(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    for kw, param in (({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
                      ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
                      ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
                       "response_format"),
                      ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}},
                       None),
                      ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                          "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,500}"}
                                                           for i in range(4000)}}}}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert e.value.status_code == 400
        if param is not None:
            assert e.value.body["param"] == param
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                         response_format={"type": "json_object"}, temperature=1.0, seed=1)
    assert out.choices[0].message.content is not None       # the instances are alive and still constrain
