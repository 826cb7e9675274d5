"""Hostile request bodies, without a server: every case either raises
``BadRequest`` naming the right field or is accepted and normalised, and whatever the API accepts
packs for the wire and is sampled by the engine sampler without error. Ends with hypothesis
properties over arbitrary JSON bodies and mutations of valid requests."""

from __future__ import annotations

import json
import math
import re

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laneserve.cluster.messages import (Add, InvalidMessage, RequestDesc, StartInfo, Transfer, decode, encode,
                                        sampling_from_dict, WireSLO)
from laneserve.core.sampling import INT64_MAX, INT64_MIN
from laneserve.core.slo import SLO
from laneserve.engine.sampler import Sampler, TokenHistory
from laneserve.server import protocol
from laneserve.server.protocol import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_JSON_DEPTH, MAX_MESSAGES,
                                       MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, BadRequest, GenerateInput,
                                       ServerDefaults, parse_body, parse_chat, parse_completion)

VOCAB = 50
MAX_MODEL_LEN = 100
DEFAULTS = ServerDefaults(default_slo=SLO(1.0, 0.1))


class CharTokenizer:
    """One token per character (mod the vocabulary) and a plain chat template."""

    chat_template = "plain"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        return "".join(f"{m['role'][0]}:{m['content']};" for m in messages) + ("a:" if add_generation_prompt else "")


TOKENIZER = CharTokenizer()


def completion(body, headers=None, tokenizer=None):
    return parse_completion(body, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, kv_tokens=80,
                            headers=headers or {}, defaults=DEFAULTS)


def completion_text(body, headers=None):
    return completion(body, headers, TOKENIZER)


def chat(body, headers=None):
    return parse_chat(body, tokenizer=TOKENIZER, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, kv_tokens=MAX_MODEL_LEN,
                      headers=headers or {}, defaults=DEFAULTS)


def assert_usable(gi: GenerateInput) -> None:
    """What the API does after admission: pack for the wire, decode on the instance, sample."""
    desc = RequestDesc(7, gi.prompt_ids, gi.sampling, 0.0, WireSLO.of(gi.slo), gi.slo_class, gi.priority)
    kids = tuple(range(8, 7 + gi.sampling.n))
    req = decode(encode(Add(desc, kids)), vocab_size=VOCAB).request.request()
    assert req.sampling == gi.sampling
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    history = TokenHistory(req, req.sampling, req.prompt_token_ids, VOCAB, torch.device("cpu"), eos_token_ids=[0])
    later = TokenHistory(req, req.sampling, req.prompt_token_ids, VOCAB, torch.device("cpu"), eos_token_ids=[0])
    later.extend([1, 2, 1])
    tokens, _ = Sampler(0).sample(logits, [req.sampling, req.sampling], [0, 3], [history, later])
    assert all(0 <= t < VOCAB for t in tokens)


# ---- the body -------------------------------------------------------------------------------------
BAD_BODIES = [
    ("5000-deep arrays", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
    ("5000-deep objects", b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nests deeper"),
    ("deep and unclosed", b"[" * 100_000, "nests deeper"),
    ("100k-digit integer", b'{"seed": ' + b"7" * 100_000 + b"}", "number too large"),
    ("float overflow", b'{"temperature": 1e999}', "out of range"),
    ("negative float overflow", b'{"temperature": -1e999}', "out of range"),
    ("huge exponent", b'{"top_p": 1e' + b"9" * 5000 + b"}", "out of range"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    ("encoded surrogate bytes", b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8"),
    ("UTF-16 body", '{"prompt": "hi"}'.encode("utf-16"), "not valid UTF-8"),
    ("lone high surrogate", b'{"model": "m", "prompt": "hi \\ud800"}', "lone surrogate"),
    ("lone low surrogate in a key", b'{"\\udc00": 1}', "lone surrogate"),
    ("lone surrogate nested", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "lone surrogate"),
    ("reversed surrogate pair", b'{"prompt": "\\ude00\\ud83d"}', "lone surrogate"),
    ("duplicate key", b'{"temperature": 0.5, "temperature": 0.7}', "duplicate key"),
    ("truncated", b'{"model": "m", "prompt": ', "malformed JSON"),
    ("unterminated string among many brackets", b"[" * 40 + b'"abc', "nests deeper"),
    ("unterminated deep string", b'[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["' + b'\\"' * 1000, "nests deeper"),
    ("empty", b"", "malformed JSON"),
    ("trailing garbage", b'{"a": 1} x', "malformed JSON"),
]


@pytest.mark.parametrize("raw,message", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_hostile_bodies_are_400(raw, message):
    with pytest.raises(BadRequest, match=message):
        parse_body(raw)


def test_body_depth_limit_and_what_passes():
    nested = lambda d: b"[" * d + b"]" * d  # noqa: E731
    assert parse_body(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(BadRequest, match="nests deeper"):
        parse_body(nested(MAX_JSON_DEPTH + 1))
    assert parse_body(nested(5), max_depth=5) is not None
    # brackets and quotes inside strings do not count
    body = {"prompt": "[" * 5000 + '{"\\"' + "}" * 10, "stop": ["]]]", "[["] * 16}
    assert parse_body(json.dumps(body).encode()) == body
    # a valid surrogate pair, an escaped backslash before "u", and non-ASCII text are fine
    assert parse_body(b'{"p": "\\ud83d\\ude00 \\\\ud800 \xc3\xa9"}') == {"p": "\U0001F600 \\ud800 \u00e9"}
    # NaN / Infinity literals parse, so that the field check can name the field
    assert math.isnan(parse_body(b'{"temperature": NaN}')["temperature"])
    ints = parse_body(b'{"seed": ' + b"9" * 300 + b"}")         # long but parseable: the field rejects it
    with pytest.raises(BadRequest) as e:
        completion({"model": "m", "prompt": [1], **ints})
    assert e.value.param == "seed" and "outside int64" in str(e.value)


# ---- the fields ----------------------------------------------------------------------------------
BASE = {"model": "m", "prompt": [1, 2, 3]}
BAD_FIELDS = [
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": -float("inf")}, "temperature", "finite"),
    ({"temperature": 2.5}, "temperature", "must be in"),
    ({"temperature": -1e-300}, "temperature", "must be in"),
    ({"temperature": 10 ** 400}, "temperature", "must be in"),
    ({"temperature": "0.5"}, "temperature", "must be a number"),
    ({"temperature": True}, "temperature", "must be a number"),
    ({"top_p": float("nan")}, "top_p", "finite"),
    ({"top_p": 0}, "top_p", "must be in"),
    ({"top_p": 1.0000001}, "top_p", "must be in"),
    ({"seed": 2 ** 63}, "seed", "<="),
    ({"seed": 2 ** 64}, "seed", "<="),
    ({"seed": -(2 ** 63) - 1}, "seed", ">="),
    ({"seed": 1.5}, "seed", "integer"),
    ({"seed": True}, "seed", "integer"),
    ({"top_k": 2 ** 64}, "top_k", "<="),
    ({"top_k": -2}, "top_k", ">= -1"),
    ({"top_k": 5.0}, "top_k", "integer"),
    ({"priority": 2 ** 64}, "priority", "<="),
    ({"priority": -(2 ** 63) - 1}, "priority", ">="),
    ({"priority": "1"}, "priority", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 2 ** 64}, "max_tokens", "<="),
    ({"max_tokens": 98}, "max_tokens", "maximum context length"),
    ({"max_tokens": 1.0}, "max_tokens", "integer"),
    ({"stop_token_ids": [2 ** 64]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", "at most"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "must be an integer"),
    ({"stop_token_ids": 7}, "stop_token_ids", "list of integers"),
    ({"logprobs": 21}, "logprobs", r"in \[0, 20\]"),
    ({"logprobs": -1}, "logprobs", r"in \[0, 20\]"),
    ({"n": float("nan")}, "n", "must be an integer"),
    ({"n": 3, "best_of": 2}, "best_of", "must be >= 'n'"),
    ({"presence_penalty": float("inf")}, "presence_penalty", "finite"),
    ({"logit_bias": {str(VOCAB): 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"1": float("nan")}}, "logit_bias", "finite"),
    ({"logit_bias": [1]}, "logit_bias", "must be an object"),
    ({"user": "u" * 2000}, "user", "longer than"),
    ({"user": 5}, "user", "must be a string"),
    ({"model": "m" * 2000}, "model", "longer than"),
    ({"model": ["m"]}, "model", "must be a string"),
    ({"stream": 1}, "stream", "boolean"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "'stream_options.include_usage' must be a boolean"),
    ({"ignore_eos": None, "return_token_ids": "true"}, "return_token_ids", "boolean"),
    ({"slo": {"ttft_ms": float("nan")}}, "slo", "'slo.ttft_ms' must be a number > 0"),
    ({"slo": {"tpot_ms": float("inf")}}, "slo", "'slo.tpot_ms' must be a number > 0"),
    ({"slo": {"ttft_ms": 1e12}}, "slo", "<= 86400000"),
    ({"slo": {"ttft_ms": 10 ** 400}}, "slo", "must be a number > 0"),
    ({"slo": {"ttft_ms": "500"}}, "slo", "must be a number > 0"),
    ({"slo": {"x" * 10_000: 1}}, "slo", "unknown field"),
    ({"slo_class": "a\nb", "slo": {"ttft_ms": 1, "tpot_ms": 1}}, "slo_class", "label"),
    ({"slo_class": "c" * 65, "slo": {"ttft_ms": 1, "tpot_ms": 1}}, "slo_class", "label"),
    ({"slo_class": 3}, "slo_class", "must be a string"),
    ({"prompt": [1, 2 ** 64]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1, -1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1.0, 2.0]}, "prompt", "string or a list of token ids"),
    ({"prompt": [[[[1]]]]}, "prompt", "or a batch: a list of strings or token-id lists"),
    ({"prompt": {"ids": [1]}}, "prompt", "string or a list of token ids"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1] * 200}, "prompt", "maximum context length"),
]


@pytest.mark.parametrize("fields,param,message", BAD_FIELDS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_FIELDS)])
def test_bad_fields_are_400_naming_the_field(fields, param, message):
    with pytest.raises(BadRequest, match=message) as e:
        completion({**BASE, **fields})
    assert e.value.param == param
    assert len(str(e.value)) < 400               # no unbounded echo of client input


@pytest.mark.parametrize("header,value", [("x-slo-ttft-ms", "nan"), ("x-slo-ttft-ms", "inf"),
                                          ("x-slo-tpot-ms", "1e999"), ("x-slo-tpot-ms", "-5"),
                                          ("x-slo-ttft-ms", "0"), ("x-slo-ttft-ms", "1e12"),
                                          ("x-slo-ttft-ms", "fast"), ("x-slo-ttft-ms", "9" * 5000)])
def test_bad_slo_headers_are_400(header, value):
    with pytest.raises(BadRequest) as e:
        completion(BASE, {header: value})
    assert e.value.param == header


def test_body_shape_and_unknown_fields(caplog, monkeypatch):
    for body in ([BASE], "prompt", None, 5):
        with pytest.raises(BadRequest, match="JSON object"):
            completion(body)
    with pytest.raises(BadRequest, match="field names must be strings"):
        completion({**BASE, 1: 2})
    # as vLLM: an unknown top-level field is ignored and its name logged once, bounded
    monkeypatch.setattr(protocol, "_logged_unknown", set())
    with caplog.at_level("WARNING", logger="laneserve.server"):
        for _ in range(2):
            assert completion({**BASE, "k" * 100_000: 1}).prompt_ids == BASE["prompt"]
    logged = [r.getMessage() for r in caplog.records if "kkk" in r.getMessage()]
    assert len(logged) == 1 and len(logged[0]) < 200
    # inside 'slo' a typo is still refused, without echoing the key unbounded
    with pytest.raises(BadRequest, match="unknown field 'slo.kkk") as e:
        completion({**BASE, "slo": {"k" * 100_000: 1}})
    assert len(str(e.value)) < 200 and e.value.param == "slo"


def test_accepted_values_are_normalised_and_usable():
    # vLLM: a temperature below 1e-5 is greedy; 1e-5 itself samples
    for t in (1e-40, 5e-324, 9.9e-6, 0):
        gi = completion({**BASE, "temperature": t})
        assert gi.sampling.temperature == 0.0 and gi.sampling.greedy
        assert_usable(gi)
    gi = completion({**BASE, "temperature": 1e-5, "seed": 3})
    assert gi.sampling.temperature == 1e-5 and not gi.sampling.greedy
    assert_usable(gi)
    # the issue's seed (1.9e13 overflowed seed * 1_000_003 in torch.manual_seed) and int64's ends
    for seed in (19_000_000_000_000, INT64_MAX, INT64_MIN, -1):
        gi = completion({**BASE, "seed": seed, "temperature": 1.0})
        assert gi.sampling.seed == seed
        assert_usable(gi)
    # top_k: 0 and anything >= the vocabulary mean off
    assert completion({**BASE, "top_k": 0}).sampling.top_k == -1
    assert completion({**BASE, "top_k": INT64_MAX}).sampling.top_k == -1
    assert completion({**BASE, "top_k": VOCAB - 1}).sampling.top_k == VOCAB - 1
    # the vLLM sampling fields, at their ends
    gi = completion({**BASE, "logit_bias": {"1": 100, "0": -100}, "presence_penalty": -2, "frequency_penalty": 2,
                     "repetition_penalty": 0.01, "min_tokens": 16, "temperature": 0.5})
    assert gi.sampling.logit_bias == ((1, 100.0), (0, -100.0)) and gi.sampling.min_tokens == 16
    assert_usable(gi)
    gi = completion({**BASE, "priority": INT64_MIN, "stop_token_ids": [0, VOCAB - 1] * 128, "logprobs": 20,
                     "top_p": 5e-324, "slo": {"ttft_ms": 86_400_000, "tpot_ms": 1e-300}, "max_tokens": 77})
    assert gi.priority == INT64_MIN and gi.slo.ttft == 86_400.0 and gi.slo.tpot == pytest.approx(1e-303)
    assert_usable(gi)
    gi = completion(BASE, {"x-slo-ttft-ms": " 250 "})
    assert gi.slo.ttft == 0.25
    gi = completion({**BASE, "slo_class": "batch-2.a:b", "slo": {"ttft_ms": 1, "tpot_ms": 1}})
    assert gi.slo_class == "batch-2.a:b"
    gi = completion({**BASE, "prompt": "x" * 60, "stop": ["s" * 256] * MAX_STOP_STRINGS}, tokenizer=TOKENIZER)
    assert len(gi.sampling.stop) == MAX_STOP_STRINGS
    with pytest.raises(BadRequest, match="at most") as e:
        completion({**BASE, "prompt": "x", "stop": ["s" * 257]}, tokenizer=TOKENIZER)
    assert e.value.param == "stop"
    with pytest.raises(BadRequest, match="characters, more than can fit") as e:
        completion({**BASE, "prompt": "x" * (MAX_MODEL_LEN * 64 + 1)}, tokenizer=TOKENIZER)
    assert e.value.param == "prompt"


def test_the_issue_bodies_through_parse_body():
    """The exact failures, from raw bytes: each a 400 naming the field, or greedy."""
    def run(raw: bytes):
        return completion(parse_body(raw))
    for raw, param in ((b'{"model": "m", "prompt": [1], "temperature": NaN}', "temperature"),
                       (b'{"model": "m", "prompt": [1], "top_p": NaN}', "top_p"),
                       (b'{"model": "m", "prompt": [1], "temperature": Infinity}', "temperature"),
                       (b'{"model": "m", "prompt": [1], "seed": 18446744073709551616}', "seed"),
                       (b'{"model": "m", "prompt": [1], "top_k": 18446744073709551616}', "top_k"),
                       (b'{"model": "m", "prompt": [1], "priority": 18446744073709551616}', "priority"),
                       (b'{"model": "m", "prompt": [1], "stop_token_ids": [18446744073709551616]}', "stop_token_ids")):
        with pytest.raises(BadRequest) as e:
            run(raw)
        assert e.value.param == param, raw
    gi = run(b'{"model": "m", "prompt": [1], "temperature": 1e-40, "seed": 19000000000000}')
    assert gi.sampling.greedy
    assert_usable(gi)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages", "at most"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]}, "messages", "parts"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages", "role must be"),
    ({"messages": [{"role": "r" * 10_000, "content": "x"}]}, "messages", "role must be"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "content must be"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN * 64 + 1)}]}, "messages", "more than can fit"),
    ({"messages": {"role": "user"}}, "messages", "non-empty list"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}},
     "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"deep": {"a": [1]}}}, "chat_template_kwargs", "must be null"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "chat_template_kwargs", "must be null"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, "chat_template_kwargs", "at most"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"metadata": {"k": 1}}, "metadata", "'metadata.k' must be a string"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "'metadata.k' is longer than 512"),
    ({"service_tier": ["auto"]}, "service_tier", "must be a string"),
    ({"store": "no"}, "store", "boolean"),
    ({"parallel_tool_calls": 0}, "parallel_tool_calls", "boolean"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", r"in \[0, 20\]"),
    ({"logprobs": "yes"}, "logprobs", "boolean"),
    ({"max_completion_tokens": 2 ** 64}, "max_completion_tokens", "<="),
    ({"temperature": float("nan")}, "temperature", "finite"),
]


@pytest.mark.parametrize("fields,param,message", BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_CHAT)])
def test_bad_chat_fields_are_400(fields, param, message):
    with pytest.raises(BadRequest, match=message) as e:
        chat({**CHAT, **fields})
    assert e.value.param == param


def test_chat_template_failures_are_400():
    class Raising(CharTokenizer):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            raise RuntimeError("x" * 10_000)

    class NotText(CharTokenizer):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            return [1, 2]

    for tok, message in ((Raising(), "chat template failed"), (NotText(), "did not produce text")):
        with pytest.raises(BadRequest, match=message) as e:
            parse_chat(CHAT, tokenizer=tok, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, kv_tokens=MAX_MODEL_LEN,
                       headers={}, defaults=DEFAULTS)
        assert len(str(e.value)) < 400
    gi = chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}, "metadata": {"a": "b"},
               "temperature": 1e-30})
    assert gi.sampling.greedy
    assert_usable(gi)


# ---- the wire: a bad message fails with ValueError, nothing else -------------------------------------
def _transfer_wire(**over) -> bytes:
    """A transfer as the wire holds it, its request fields (``rid``, ``prompt``, ``sp``, ...) or its
    own (``out``, ``computed``, ``t_first``, ``info``) replaced by ``over``."""
    gi = completion({**BASE, "seed": 5, "temperature": 0.5})
    msg = Transfer(RequestDesc(3, gi.prompt_ids, gi.sampling, 1.0, WireSLO.of(gi.slo)), [4], 3, 1.5,
                   info=StartInfo(0.5, 1.0))
    raw = msgpack.unpackb(encode(msg))
    own = {"out": 2, "computed": 3, "t_first": 4, "info": 6}
    for key, value in over.items():
        if key in own:
            raw[own[key]] = value
        else:
            raw[1][key] = value
    return msgpack.packb(raw)


@pytest.mark.parametrize("over,field", [
    ({"sp": None}, "request.sp"), ({"sp": [1]}, "request.sp"), ({"rid": "3"}, "request.rid"),
    ({"prompt": "abc"}, "request.prompt"), ({"prompt": [1, -2]}, "request.prompt"),
    ({"prompt": [1, 2 ** 63]}, "request.prompt"), ({"prompt": [1, VOCAB]}, "request.prompt"),
    ({"prompt": []}, "request.prompt"), ({"slo": {"ttft": 0, "tpot": 1}}, "request.slo.ttft"),
    ({"slo": "fast"}, "request.slo"), ({"slo": {"ttft": float("nan"), "tpot": 1.0}}, "request.slo.ttft"),
    ({"arrival": float("nan")}, "request.arrival"), ({"arrival": None}, "request.arrival"),
    ({"cls": 5}, "request.cls"), ({"prio": 2 ** 63}, "request.prio"), ({"prio": 1.5}, "request.prio"),
    ({"computed": "x"}, "computed"), ({"t_first": float("inf")}, "t_first"), ({"computed": 99}, "computed"),
    ({"out": [1, VOCAB]}, "out"), ({"info": ["x", None, 0, 0, None]}, "info.prefill_start"),
])
def test_a_malformed_transfer_raises_value_error_naming_the_field(over, field):
    with pytest.raises(ValueError, match=re.escape(f"'{field}") + r"['.\[]") as e:
        decode(_transfer_wire(**over), vocab_size=VOCAB)
    assert isinstance(e.value, InvalidMessage) and e.value.kind == "transfer"
    assert e.value.rids == ((3,) if "rid" not in over else ())    # an instance fails this request alone


def test_a_transfer_needs_its_fields_and_roundtrips():
    raw = msgpack.unpackb(_transfer_wire())
    del raw[1]["sp"]
    with pytest.raises(ValueError, match="'request.sp' is missing"):
        decode(msgpack.packb(raw))
    (req,) = decode(_transfer_wire(out=[4, 5], computed=4, t_first=2.0)).requests()
    assert req.output_token_ids == [4, 5] and req.num_computed_tokens == 4 and req.times.first_token == 2.0
    assert req.times.prefill_start == 0.5 and req.request_id == 3


@pytest.mark.parametrize("sp", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}, {"temperature": "1"},
    {"max_tokens": True}, {"max_tokens": 2 ** 63}, {"seed": 2 ** 63}, {"seed": 1.0}, {"top_k": 0},
    {"top_k": 2 ** 63}, {"stop_token_ids": 5}, {"stop_token_ids": [-1]}, {"stop_token_ids": ["a"]}, {"stop": "abc"},
    {"stop": [""]}, {"stop": [1]}, {"ignore_eos": 1}, {"logprobs": 21}, {"logprobs": 2.0},
])
def test_sampling_from_dict_rejects_bad_values(sp):
    with pytest.raises(ValueError):
        sampling_from_dict(sp)


# ---- properties ------------------------------------------------------------------------------------
JSON_SCALARS = (st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
                | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
                | st.sampled_from([2 ** 63, 2 ** 64, -(2 ** 63) - 1])
                | st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
# values near the accepted ranges, so that shaped bodies are often accepted and must then be usable
PLAUSIBLE = (st.none() | st.booleans() | st.integers(min_value=-2, max_value=VOCAB + 2)
             | st.floats(min_value=0, max_value=2.5) | st.lists(st.integers(min_value=-1, max_value=VOCAB), max_size=5)
             | st.sampled_from([1e-40, 1e-5, 19_000_000_000_000, INT64_MAX, INT64_MIN, "text", {"type": "text"}]))


def _shaped(fields: set[str], required: dict) -> st.SearchStrategy:
    optional = {f: PLAUSIBLE | JSON_VALUES for f in sorted(fields - set(required))}
    return st.fixed_dictionaries(required, optional=optional)


SHAPED_COMPLETIONS = _shaped(COMPLETION_FIELDS, {"model": st.just("m"),
                                                 "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
                                                 | st.text(min_size=1, max_size=8) | JSON_VALUES})
SHAPED_CHATS = _shaped(CHAT_FIELDS, {"model": st.just("m"),
                                     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]),
                                                                                 "content": st.text(max_size=8)
                                                                                 | JSON_VALUES}), max_size=3)})
VALID_COMPLETION = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                    "top_k": 5, "seed": 11, "stop_token_ids": [4], "logprobs": 2, "stream": True,
                    "stream_options": {"include_usage": True}, "priority": 1, "slo": {"ttft_ms": 500, "tpot_ms": 50}}
VALID_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 5,
              "temperature": 0.7, "seed": 11, "logprobs": True, "top_logprobs": 2, "stop": ["x"],
              "chat_template_kwargs": {"enable_thinking": False}}


def _parse_or_bad_request(parse, body, headers=None) -> None:
    """The property: a usable GenerateInput, or BadRequest — never any other exception."""
    try:
        gi = parse(body, headers)
    except BadRequest:
        return
    assert_usable(gi)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=JSON_VALUES | SHAPED_COMPLETIONS | SHAPED_CHATS)
def test_property_arbitrary_json_bodies(body):
    _parse_or_bad_request(completion, body)
    _parse_or_bad_request(completion_text, body)
    _parse_or_bad_request(chat, body)
    try:                                        # the same value through the bytes path
        parsed = parse_body(json.dumps(body).encode())
    except BadRequest:
        return
    _parse_or_bad_request(completion, parsed)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), is_chat=st.booleans())
def test_property_mutated_valid_requests(data, is_chat):
    body = dict(VALID_CHAT if is_chat else VALID_COMPLETION)
    fields = sorted(CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
    for name in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[name] = data.draw(JSON_VALUES)
    headers = data.draw(st.dictionaries(st.sampled_from(["x-slo-ttft-ms", "x-slo-tpot-ms"]),
                                        st.text(max_size=8) | st.floats().map(str), max_size=2))
    _parse_or_bad_request(chat if is_chat else completion_text, body, headers)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_property_parse_body_returns_json_or_bad_request(raw):
    try:
        parse_body(raw)
    except BadRequest:
        pass


def test_bad_fields_are_rejected_before_tokenization():
    class Counting(CharTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=True):
            Counting.calls += 1
            return super().encode(text)

    tok = Counting()
    for body, parse in (({"model": "m", "prompt": "x" * 50, "temperature": float("nan")}, parse_completion),
                        ({"model": "m", "prompt": "x" * 50, "seed": 2 ** 64}, parse_completion),
                        ({**CHAT, "top_p": 0}, parse_chat), ({**CHAT, "stop_token_ids": [-1]}, parse_chat),
                        ({"model": "m", "prompt": "x" * 50, "logit_bias": {"999": 1}}, parse_completion),
                        ({"model": "m", "prompt": "x" * 50, "min_tokens": 17}, parse_completion),
                        ({**CHAT, "max_tokens": 4, "min_tokens": 5}, parse_chat)):
        with pytest.raises(BadRequest):
            parse(body, tokenizer=tok, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, kv_tokens=MAX_MODEL_LEN,
                  headers={}, defaults=DEFAULTS)
    assert Counting.calls == 0


# ---- structured output ---------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tokenizer():
    from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer
    tok = byte_level_tokenizer(1024)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _structured_chat(fields, tokenizer):
    return parse_chat({**CHAT, **fields}, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=1024,
                      kv_tokens=MAX_MODEL_LEN, headers={}, defaults=DEFAULTS)


_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
BAD_STRUCTURED = [
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "grammar|undefined_rule"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "grammar|missing"),
    ({"guided_grammar": ""}, "guided_grammar", "non-empty"),
    ({"guided_regex": "a(b"}, "guided_regex", "cannot compile|regex"),
    ({"guided_regex": "x" * 5000}, "guided_regex", "longer than"),
    ({"guided_json": [1, 2]}, "guided_json", "JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "unknown response_format"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,500}"} for i in range(4000)}}}}},
     "response_format", "over the limit of 131072 bytes"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems cannot be enforced"),
    ({"guided_json": {"type": "string", "format": "x-custom"}}, "guided_json", "Unknown format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}},
     "guided_json", "backreferences"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "only one"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "non-empty tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools", "not valid JSON|schema object"),
]


@pytest.mark.parametrize("fields,param,message", BAD_STRUCTURED,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_STRUCTURED)])
def test_bad_structured_specs_are_400_naming_the_field(fields, param, message, byte_tokenizer):
    with pytest.raises(BadRequest, match=message) as e:
        _structured_chat(fields, byte_tokenizer)
    assert e.value.param == param


def test_structured_specs_need_a_tokenizer_and_are_usable(byte_tokenizer):
    with pytest.raises(BadRequest, match="needs a tokenizer") as e:
        completion({"model": "m", "prompt": [1], "guided_regex": "a+"})
    assert e.value.param == "guided_regex"
    for fields in ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _SCHEMA}}},
                   {"guided_choice": ["yes", "no"]}, {"structured_outputs": {"regex": "[0-9]{3}"}},
                   {"guided_grammar": 'start: "yes" | "no" NUM\nNUM: /[0-9]+/'},
                   {"guided_grammar": 'root ::= "a" [0-9]+'},
                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": _SCHEMA}}],
                    "tool_choice": "required", "parallel_tool_calls": False}):
        gi = _structured_chat(fields, byte_tokenizer)
        assert gi.sampling.structured is not None
        sp = decode(encode(Add(RequestDesc(1, gi.prompt_ids, gi.sampling, 0.0)))).request.sampling
        assert sp == gi.sampling                    # the spec crosses the wire unchanged
    deep = {"response_format": {"type": "json_schema", "json_schema": {"schema": _nested_schema(12)}}}
    assert _structured_chat(deep, byte_tokenizer).sampling.structured.kind == "json_schema"
    too_deep = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": _nested_schema(40)}}}
    with pytest.raises(BadRequest, match="nests deeper"):
        parse_body(json.dumps(too_deep).encode())
    assert _structured_chat({"response_format": {"type": "text"}, "tool_choice": "auto"},
                            byte_tokenizer).sampling.structured is None
