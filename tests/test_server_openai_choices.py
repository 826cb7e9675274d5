"""Several choices per request with the official ``openai`` client against one
live 1P+1D server of the smoke model: ``n`` (the prompt prefilled once; greedy samples identical
to n=1, seeded sample k identical to an n=1 request seeded ``seed + k``), ``best_of``, batched
prompts (strings and token-id lists, choices indexed across prompts, usage summed, streamed with
each choice's index), ``echo``, and streamed tool calls (``delta.tool_calls``)."""

from __future__ import annotations

import json

import pytest
from server_support import TIMEOUT, WEATHER_TOOLS, wait_all_free, wait_for

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
PROMPT = "serve the model token serve the model token prefill decode serve"
OTHER = "hello the world hello"


@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)


def _tokens(choice) -> list[int]:
    return choice.model_dump()["token_ids"]


def _complete(client, prompt=PROMPT, **kw):
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=kw.pop("max_tokens", 8),
                                     extra_body=extra, **kw)


def test_n_greedy_samples_equal_n1_and_seeded_samples_follow_derived_seeds(server, client):
    one = _tokens(_complete(client, temperature=0).choices[0])
    four = _complete(client, temperature=0, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert all(_tokens(c) == one for c in four.choices)
    assert four.usage.completion_tokens == 4 * 8 and four.usage.prompt_tokens == len(four.choices[0].model_dump()[
        "prompt_token_ids"])
    # the decode instance imported the prompt KV once: samples 1-3 forked sample 0's blocks
    wait_for(lambda: (server.state()["instances"][1]["kv_forks"] or 0) >= 3, 10, "the decode instance's fork count")
    three = _complete(client, temperature=1.0, seed=11, n=3)
    got = [_tokens(c) for c in three.choices]
    # sample k draws with seed + k (vLLM's derivation): each equals an n=1 request with that seed
    assert got == [_tokens(_complete(client, temperature=1.0, seed=11 + k).choices[0]) for k in range(3)]
    assert len({tuple(t) for t in got}) > 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert wait_all_free(server)["in_flight"] == 0


def test_n_with_one_token_and_a_stop_string_per_sample(client):
    out = _complete(client, temperature=1.0, seed=5, n=3, max_tokens=1)
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    assert [len(_tokens(c)) for c in out.choices] == [1, 1, 1]
    texts = [c.text for c in _complete(client, temperature=1.0, seed=5, n=3, max_tokens=12).choices]
    stop = texts[1][2:4]                      # a string inside sample 1's text
    cut = _complete(client, temperature=1.0, seed=5, n=3, max_tokens=12, stop=[stop]).choices
    for text, c in zip(texts, cut):
        if stop in text:
            assert c.text == text[:text.index(stop)] and c.finish_reason == "stop"
        else:
            assert c.text == text and c.finish_reason == "length"


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client):
    all3 = _complete(client, temperature=1.0, seed=21, n=3, logprobs=0)
    cum = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = _complete(client, temperature=1.0, seed=21, n=2, best_of=3, logprobs=0)
    order = sorted(range(3), key=lambda k: cum[k], reverse=True)[:2]
    assert [_tokens(c) for c in best.choices] == [_tokens(all3.choices[k]) for k in order]
    assert best.usage.completion_tokens == 16
    plain = _complete(client, temperature=1.0, seed=21, n=1, best_of=3)        # logprobs not asked: none shown
    assert _tokens(plain.choices[0]) == _tokens(all3.choices[order[0]]) and plain.choices[0].logprobs is None
    for kw, param in (({"n": 3, "best_of": 2}, "best_of"), ({"n": 1, "best_of": 2, "stream": True}, "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            _complete(client, **kw)
        assert e.value.body["param"] == param


def test_batched_prompts_index_choices_across_prompts_and_sum_usage(server, client):
    singles = [_complete(client, p, temperature=0) for p in (PROMPT, OTHER)]
    batch = _complete(client, [PROMPT, OTHER], temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [_tokens(c) for c in batch.choices] == [_tokens(singles[0].choices[0])] * 2 + [
        _tokens(singles[1].choices[0])] * 2
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    ids = [s.choices[0].model_dump()["prompt_token_ids"] for s in singles]
    by_ids = _complete(client, ids, temperature=0)
    assert [_tokens(c) for c in by_ids.choices] == [_tokens(s.choices[0]) for s in singles]
    stream = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], n=2, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, finish, usage = ["", "", "", ""], [None] * 4, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in batch.choices] and finish == ["length"] * 4
    assert usage.completion_tokens == batch.usage.completion_tokens
    from laneserve.server.protocol import MAX_BATCH_PROMPTS
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, ["a"] * (MAX_BATCH_PROMPTS + 1))
    assert e.value.body["param"] == "prompt"
    assert wait_all_free(server)["in_flight"] == 0


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = _complete(client, temperature=0)
    echoed = _complete(client, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_echo_with_logprobs_and_prompt_logprobs_are_the_engines(client):
    """``echo`` + ``logprobs``: the prompt's tokens lead the logprobs (the first without one), and
    their values are the engine's own prompt logprobs for the same token ids (an in-process LLM on
    the same smoke model); vLLM's ``prompt_logprobs`` field gives the same values per token, and a
    streamed answer carries the same prompt part in each choice's first chunk."""
    from laneserve.core import SamplingParams
    from laneserve.engine.llm import LLM
    out = _complete(client, temperature=0, echo=True, logprobs=2, extra_body={"prompt_logprobs": 1})
    choice = out.choices[0]
    ids = choice.prompt_token_ids
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 8 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    plp = choice.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])] == lp.token_logprobs[1:len(ids)]

    llm = LLM(quiet=True)
    req = llm._make_request(list(ids), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    llm.instance.submit(req)
    llm.instance.run_until_idle()
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e[0] for e in req.prompt_logprobs], abs=1e-4)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.token_logprobs[0] is None
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def _streamed_calls(client, **kw) -> tuple[dict[int, dict], str | None, int]:
    calls: dict[int, dict] = {}
    finish, chunks = None, 0
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                                tools=WEATHER_TOOLS, temperature=1.0, max_tokens=200, stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
                chunks += 1
            assert not c.delta.content
            finish = c.finish_reason or finish
    return calls, finish, chunks


def test_streamed_tool_calls(client):
    calls, finish, chunks = _streamed_calls(client, seed=3, tool_choice={"type": "function",
                                                                         "function": {"name": "get_weather"}})
    assert finish == "stop" and list(calls) == [0] and chunks > 2       # the arguments arrive in pieces
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and len(args["city"]) <= 10
    calls, finish, _ = _streamed_calls(client, seed=5, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] in ("get_weather", "ping") and isinstance(json.loads(calls[0]["arguments"]), dict)


def test_chat_prompt_logprobs_cover_the_templated_prompt_once(client):
    """vLLM's ``prompt_logprobs`` on chat: one list beside the choices, one entry per token of the
    rendered chat template (the first None), each holding that token; with ``stream`` it is refused."""
    messages = [{"role": "user", "content": OTHER}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    ids = out.choices[0].model_dump()["prompt_token_ids"]
    plp = out.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) > 3
    for t, entry in zip(ids[1:], plp[1:]):
        assert str(t) in entry and entry[str(t)]["logprob"] <= 0
        assert 1 <= len(entry) <= 3          # the token itself and the top 2
    assert all("prompt_logprobs" not in c.model_dump() for c in out.choices)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert "prompt_logprobs" in str(err.value)
