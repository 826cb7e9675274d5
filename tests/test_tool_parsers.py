"""Tool calling without a server: the tool-call parsers on the texts each model family writes
(streamed in pieces of every size, and whole), and the chat messages of a tool conversation as
the chat template sees them (tools, an assistant's ``tool_calls`` with ``content: null``, a tool
message's ``tool_call_id`` and ``name``)."""

from __future__ import annotations

import json

import pytest

from laneserve.core.slo import SLO
from laneserve.server.protocol import BadRequest, ServerDefaults, chat_prompt, parse_chat
from laneserve.server.tool_parsers import AutoToolStream, get_parser, parser_names

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = [
    # parser, text, content (the text before the first call as written, as vLLM and a stream send it),
    # [(name, arguments)]
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + '}\n</tool_call>', "Let me look.\n", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": [1, 2]}}</tool_call>', None, [("a", {}), ("b", {"x": [1, 2]})]),
    ("qwen", '<tool_call>\n{"name": "ping", "arguments": {"n": true}}', None, [("ping", {"n": True})]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"k": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"k": 1}), ("b", {})]),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]", None,
     [("get_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]' + json.dumps(WEATHER), "Sure. ", [("get_weather", WEATHER)]),
    ("mistral", "[TOOL_CALLS] garbage", "[TOOL_CALLS] garbage", []),
]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parsers_extract_calls_and_content(name, text, content, calls):
    parsed = get_parser(name).extract(text)
    assert parsed.content == content
    assert _calls(parsed.calls) == calls
    for c in parsed.calls:
        assert c["type"] == "function" and c["id"]
        if name == "mistral":                    # Mistral's templates insist on 9 alphanumerics
            assert len(c["id"]) == 9 and c["id"].isalnum()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_pieces_give_the_same_answer(name, text, content, calls, size):
    stream = AutoToolStream(get_parser(name))
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    sent = "".join(d.get("content", "") for d in deltas)
    got = [c for d in deltas for c in d.get("tool_calls", [])]
    assert _calls([c for c in got]) == calls
    assert [c["index"] for c in got] == list(range(len(calls)))
    assert stream.called == bool(calls)
    if calls:       # the text before the call went out as content; the call's own text never did
        marker = {"hermes": "<tool_call>", "qwen": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(name)
        assert marker is None or marker not in sent
        assert sent == (content or "")       # exactly the content the whole answer has
    else:
        assert sent == text


# texts whose "calls" break the protocol: returned whole as content, never as tool_calls
NOT_CALLS = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"x": Infinity}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "[1]"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"x": -Infinity}}'),
    ("llama3_json", '{"name": "nope", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]{\"a\": 1}"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"x": NaN}'),
]


@pytest.mark.parametrize("name,text", NOT_CALLS)
def test_calls_that_break_the_protocol_are_content(name, text):
    names = frozenset({"get_weather", "ping"})
    parsed = get_parser(name).extract(text, names)
    assert parsed.calls == [] and parsed.content == text
    stream = AutoToolStream(get_parser(name), names)
    deltas = [stream.delta(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(d.get("content", "") for d in deltas) == text
    assert not any("tool_calls" in d for d in deltas) and not stream.called


@pytest.mark.parametrize("name,text,value", [
    ("hermes", '<tool_call>{"name": "ping", "arguments": {"s": "\\ud800 caf\u00e9"}}</tool_call>', "\ud800 caf\u00e9"),
    ("llama3_json", '{"name": "ping", "parameters": {"s": "\\ud800"}}', "\ud800"),
    ("mistral", '[TOOL_CALLS][{"name": "ping", "arguments": {"s": "x\\udc00"}}]', "x\udc00"),
])
def test_lone_surrogates_in_arguments_are_escaped(name, text, value):
    (call,) = get_parser(name).extract(text, frozenset({"ping"})).calls
    args = call["function"]["arguments"]
    args.encode("utf-8")                                    # what the response encoder does: no error
    assert json.loads(args) == {"s": value}


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        get_parser("nope")
    assert {"hermes", "llama3_json", "mistral"} <= set(parser_names())


# ---- the conversation as the template sees it -------------------------------------------------------
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
            "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
            "{{ c.function.arguments | tojson }}){% endfor %}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer
    tok = byte_level_tokenizer(1024)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def _chat(body, tokenizer, defaults):
    return parse_chat({"model": "m", **body}, tokenizer=tokenizer, max_model_len=4096, vocab_size=1024,
                      kv_tokens=4096, headers={}, defaults=defaults)


def test_tool_conversation_is_rendered_with_its_fields(tokenizer):
    defaults = ServerDefaults(SLO(), chat_template=TEMPLATE, tool_parser="hermes")
    text = chat_prompt({"messages": CONVERSATION, "tools": TOOLS}, tokenizer=tokenizer, defaults=defaults,
                       max_model_len=2048)
    assert text == ('[tool get_weather]<user>weather?<assistant>(call call_1 get_weather '
                    + json.dumps(WEATHER) + ')<tool name=get_weather id=call_1>21 C')
    gi = _chat({"messages": CONVERSATION, "tools": TOOLS, "max_tokens": 4}, tokenizer, defaults)
    assert gi.prompts[0].text == text and gi.tool_parser == "hermes"
    for choice in ("none", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert _chat({"messages": CONVERSATION, "tools": TOOLS, "tool_choice": choice, "max_tokens": 4}, tokenizer,
                     defaults).tool_parser is None
    # the served template is used when --chat-template is not given
    plain = _chat({"messages": CONVERSATION, "max_tokens": 4}, tokenizer, ServerDefaults(SLO()))
    assert plain.prompts[0].text == "weather?21 C"


def test_auto_tool_choice_needs_the_server_flags_and_null_content_needs_tool_calls(tokenizer):
    off = ServerDefaults(SLO())
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(BadRequest, match="--enable-auto-tool-choice and --tool-call-parser") as e:
            _chat({"messages": CONVERSATION[:1], **body}, tokenizer, off)
        assert e.value.param == "tool_choice"
    assert _chat({"messages": CONVERSATION[:1], "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}, tokenizer,
                 off).tool_parser is None
    bad = [({"role": "user", "content": None}, "content must be"),
           ({"role": "assistant", "content": None}, "content must be"),
           ({"role": "user", "content": "x", "tool_calls": CONVERSATION[1]["tool_calls"]}, "only allowed"),
           ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "{oops"}}]}, "not valid JSON")]
    for msg, match in bad:
        with pytest.raises(BadRequest, match=match):
            _chat({"messages": [msg], "max_tokens": 2}, tokenizer, off)
