"""Tool calling end to end as vLLM users run it: a live server of the smoke model with a
Qwen2.5-style tool template (``tests/fixtures/qwen2_5_tools.jinja`` through ``--chat-template``)
and ``--enable-auto-tool-choice --tool-call-parser hermes``, driven by the official ``openai``
client: the tool definitions are in the prompt tokens, a tool call the model writes is parsed
into ``tool_calls`` (streamed and not), and the client's own follow-up (the assistant message
with ``content: null`` and ``tool_calls``, then a ``tool`` message with ``tool_call_id``) is
accepted and rendered.

The smoke model's weights are random, so it never writes a tool call of its own accord: the
tests make it write one with ``guided_regex`` (a regex constraint, allowed beside
``tool_choice: auto``), which is exactly the text a Qwen model writes when it calls a tool."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from server_support import WEATHER_TOOLS, serving

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
TEMPLATE = Path(__file__).parent / "fixtures" / "qwen2_5_tools.jinja"
ARGS = {"city": "Paris", "unit": "celsius"}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}</tool_call>"
# the regex that spells CALL_TEXT exactly ({ and } escaped; nothing else in it is special)
CALL_REGEX = re.sub(r"([{}\[\]])", r"\\\1", CALL_TEXT)
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    # a vllm serve line: the template, the parser, and engine flags with vLLM's names
    with serving("--colocated", "--kv-tokens", "16384", "--chat-template", str(TEMPLATE),
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--block-size", "32",
                 "--max-num-seqs", "8", "--enforce-eager", "--dtype", "auto") as srv:
        yield srv


def _detok(server, ids: list[int]) -> str:
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_tools_are_in_the_prompt_and_auto_calls_are_parsed(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER_TOOLS, max_tokens=120,
                                         extra_body={"guided_regex": CALL_REGEX, "return_token_ids": True})
    choice = out.choices[0]
    prompt = _detok(server, choice.model_dump()["prompt_token_ids"])
    for tool in WEATHER_TOOLS:                     # the template saw the tools
        assert json.dumps(tool) in prompt
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS

    # the client's own round trip: the assistant message as returned (content null), the tool result
    msgs = [*USER, choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    follow = client.chat.completions.create(model=MODEL, messages=msgs, tools=WEATHER_TOOLS, max_tokens=4,
                                            extra_body={"return_token_ids": True})
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt2 = _detok(server, follow.choices[0].model_dump()["prompt_token_ids"])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
            in prompt2)
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt2

    # without tools nothing is parsed: the same text comes back as content
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120,
                                           extra_body={"guided_regex": CALL_REGEX})
    assert plain.choices[0].message.content == CALL_TEXT and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_the_engine_flags_took_effect(server):
    state = server.state()
    assert state["decode_policy"] == "adaptive:max_batch_size=8"          # --max-num-seqs
    (inst,) = state["instances"]
    assert "decode=[adaptive:max_batch_size=8]" in inst["policy"]
    assert inst["policy_options"]["options"]["decode"]["options"]["max_batch_size"] == 8
    assert inst["kv_total_blocks"] == 16384 // 32                           # --block-size 32


def test_streamed_auto_tool_calls(server):
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER_TOOLS, tool_choice="auto",
                                            max_tokens=120, stream=True, extra_body={"guided_regex": CALL_REGEX})
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert "<tool_call>" not in content            # buffered from the marker on, never sent as text
    assert finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
