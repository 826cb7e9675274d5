"""Structured output (laneserve.engine.structured): outputs sampled from RANDOM logits under the
mask — what a random-weight model produces — always satisfy the constraint; masks, EOS, replay,
tool calls, the compile cache and the tokenizer byte mapping."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from laneserve.engine.structured import (ConstraintCache, ConstraintViolation, StructuredSpec, TokenVocabulary,
                                         UnsupportedSpec, apply, compile_constraint, parse_tool_calls,
                                         token_vocabulary)
from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer, training_corpus
from structured_support import validating

VOCAB = 512
MAX_STEPS = 3000
SEEDS = range(40)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"], "maxLength": 20},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "scores", "address", "active"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"location": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["location", "unit"]}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "limit": {"type": "integer"}}, "required": ["query"]}


@functools.cache
def tokenizer():
    return byte_level_tokenizer(VOCAB)


def check_schema(value, schema: dict) -> None:
    """Validate with a real JSON Schema validator (formats checked too)."""
    validator = validating(schema)
    errors = [e.message for e in validator.iter_errors(value)]
    assert not errors, f"{value!r} violates the schema: {errors[:3]}"


def sample(spec: StructuredSpec, seed: int, tok=None, vocab_size: int = VOCAB) -> tuple[str, list[int]]:
    """Random logits (a random-weight model), masked, sampled at temperature 1 until EOS."""
    tok = tok or tokenizer()
    state = compile_constraint(spec, tok).new_state()
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not state.is_terminated():
        assert len(out) < MAX_STEPS, "the constraint did not terminate"
        logits = torch.randn(1, vocab_size, generator=gen) * 3
        apply(logits, [state])
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        state.advance(token)
        out.append(token)
    assert out[-1] == tok.eos_token_id
    return tok.decode(out, skip_special_tokens=True), out


# ---- outputs satisfy their constraint -----------------------------------------------------------
def test_json_schema_outputs_parse_and_validate_for_every_seed():
    spec = StructuredSpec.json_schema(PERSON)
    roles = set()
    for seed in SEEDS:
        text, _ = sample(spec, seed)
        value = json.loads(text)
        check_schema(value, PERSON)
        roles.add(value["role"])
    assert len(roles) > 1        # the mask constrains, it does not dictate one output


def test_json_object_outputs_are_objects():
    for seed in range(15):
        text, _ = sample(StructuredSpec.json_object(), seed)
        assert isinstance(json.loads(text), dict)


def test_regex_and_choice_outputs_match():
    pattern = r"(ka|lo)-[0-9]{3}-[a-z]{2,4}"
    options = ["yes", "no", "maybe so", "n/a (none)"]
    seen = set()
    for seed in range(25):
        assert re.fullmatch(pattern, sample(StructuredSpec.regex(pattern), seed)[0])
        text, _ = sample(StructuredSpec.choice(options), seed)
        assert text in options
        seen.add(text)
    assert len(seen) > 1


def test_named_tool_call_arguments_match_the_function_schema():
    spec = StructuredSpec.tool("get_weather", WEATHER)
    for seed in range(15):
        text, _ = sample(spec, seed)
        [call] = parse_tool_calls(spec, text)
        assert call.name == "get_weather"
        check_schema(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_name_a_tool_and_match_its_schema(parallel):
    spec = StructuredSpec.tools_required([("get_weather", WEATHER), ("search", SEARCH), ("ping", None)],
                                         parallel=parallel)
    schemas = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object"}}
    names, counts = set(), set()
    for seed in range(20):
        text, _ = sample(spec, seed)
        calls = parse_tool_calls(spec, text)
        counts.add(len(calls))
        for call in calls:
            names.add(call.name)
            check_schema(json.loads(call.arguments), schemas[call.name])
    assert counts == {1} if not parallel else min(counts) >= 1
    assert len(names) > 1


# ---- masks, EOS, replay -------------------------------------------------------------------------
def test_eos_is_allowed_exactly_when_the_constraint_accepts():
    tok = tokenizer()
    extra_eos = 7                                  # a second EOS id, as a generation_config may list
    vocab = token_vocabulary(tok, [extra_eos])
    state = compile_constraint(StructuredSpec.regex(r"[0-9]{1,3}(ab)?"), vocab).new_state()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        mask = state.allowed_mask(VOCAB)
        assert bool(mask[tok.eos_token_id]) == bool(mask[extra_eos]) == state.accepts()
        if state.is_terminated():
            assert mask.nonzero().flatten().tolist() == sorted([tok.eos_token_id, extra_eos])
            break
        logits = torch.randn(1, VOCAB, generator=gen)
        apply(logits, [state])
        state.advance(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    assert state.is_terminated()


def test_forbidden_tokens_and_early_eos_are_violations():
    tok = tokenizer()
    state = compile_constraint(StructuredSpec.regex(r"[0-9]+"), tok).new_state()
    letter = tok.convert_tokens_to_ids("a")
    with pytest.raises(ConstraintViolation):
        state.advance(letter)
    with pytest.raises(ConstraintViolation):
        state.advance(tok.eos_token_id)
    state.advance(tok.convert_tokens_to_ids("5"))
    state.advance(tok.eos_token_id)
    with pytest.raises(ConstraintViolation):
        state.advance(tok.convert_tokens_to_ids("5"))


def test_replay_and_sync_give_the_masks_of_step_by_step_advancing():
    spec = StructuredSpec.json_schema(PERSON)
    _, tokens = sample(spec, seed=3)
    constraint = compile_constraint(spec, tokenizer())
    walker = constraint.new_state()
    masks = []
    for t in tokens:
        masks.append(walker.allowed_mask(VOCAB))
        walker.advance(t)
    synced = constraint.new_state()
    for k in range(0, len(tokens), 7):
        assert torch.equal(constraint.new_state().replay(tokens[:k]).allowed_mask(VOCAB), masks[k])
        assert torch.equal(synced.sync(tokens[:k]).allowed_mask(VOCAB), masks[k])
    assert torch.equal(synced.sync(tokens[:5]).allowed_mask(VOCAB), masks[5])   # shorter list: replays
    assert constraint.new_state().replay(tokens).is_terminated()


def test_apply_masks_a_batch_like_each_rows_mask_and_leaves_unconstrained_rows():
    tok = tokenizer()
    inside_string = compile_constraint(StructuredSpec.json_schema(WEATHER), tok).new_state()
    inside_string.replay(tok.encode('{"location": "Pa'))           # most of the vocabulary is allowed
    states = [compile_constraint(StructuredSpec.choice(["yes", "no"]), tok).new_state(), None, inside_string,
              compile_constraint(StructuredSpec.regex("[0-9]+"), tok).new_state().replay(tok.encode("12"))]
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(1))
    for layout in (logits.clone(), logits.t().clone().t()):       # contiguous and transposed storage
        apply(layout, states)
        for row, st in enumerate(states):
            if st is None:
                assert torch.equal(layout[row], logits[row])
            else:
                want = logits[row].masked_fill(~st.allowed_mask(VOCAB), float("-inf"))
                assert torch.equal(layout[row], want)
    assert 0 < states[0].allowed_mask(VOCAB).sum() < 10 and states[2].allowed_mask(VOCAB).sum() > VOCAB // 2


def test_model_vocabulary_wider_than_the_tokenizer_masks_the_padding_ids():
    state = compile_constraint(StructuredSpec.json_object(), tokenizer()).new_state()
    state.replay(tokenizer().encode('{"a": "'))
    mask = state.allowed_mask(VOCAB + 64)
    assert mask[:VOCAB].any() and not mask[VOCAB:].any()


# ---- specs, cache, tokenizers -------------------------------------------------------------------
def test_unsupported_specs_are_reported():
    with pytest.raises(UnsupportedSpec):
        StructuredSpec("xml", "<a/>")
    with pytest.raises(UnsupportedSpec):
        StructuredSpec.choice([])
    for spec, words in ((StructuredSpec.regex(r"\bword\b"), "look"),              # no look-around
                        (StructuredSpec.json_schema({"not": {"type": "string"}}), "not"),
                        (StructuredSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
                        (StructuredSpec.json_schema({"type": "string", "format": "hostname-ish"}), "format"),
                        (StructuredSpec.json_schema({"type": "string", "pattern": "^(?=a)a$"}), "look-around"),
                        (StructuredSpec.grammar("start: undefined_rule"), "undefined_rule")):
        with pytest.raises(UnsupportedSpec, match=words):
            compile_constraint(spec, tokenizer())
    # a no-op keyword is not refused: uniqueItems false constrains nothing
    compile_constraint(StructuredSpec.json_schema({"type": "array", "uniqueItems": False}), tokenizer())


def test_compiled_constraints_are_cached_by_spec_and_vocabulary_content_within_a_byte_budget():
    a, b, c = (StructuredSpec.regex(p) for p in ("[0-9]+", "[a-z]+", "x|y"))
    one = len(a.to_grammar()) + len(a.value)
    cache = ConstraintCache(max_bytes=2 * one + 2)            # room for two grammars of this size
    first = compile_constraint(a, tokenizer(), cache=cache)
    rebuilt = byte_level_tokenizer(VOCAB)                    # another object, the same vocabulary
    assert compile_constraint(a, rebuilt, cache=cache).checked is first.checked and cache.hits == 1
    compile_constraint(b, tokenizer(), cache=cache)
    compile_constraint(c, tokenizer(), cache=cache)           # evicts a, the least recently used
    assert len(cache) == 2 and cache.grammars.bytes <= cache.grammars.max_bytes
    assert compile_constraint(a, tokenizer(), cache=cache).checked is not first.checked
    assert cache.misses == 4
    huge = StructuredSpec.json_schema({"enum": ["x" * 100] * 10})
    compile_constraint(huge, tokenizer(), cache=cache)        # larger than the budget: used, not kept
    assert cache.grammars.bytes <= cache.grammars.max_bytes


def test_byte_level_token_bytes_concatenate_to_the_text():
    tok = tokenizer()
    vocab = token_vocabulary(tok)
    text = 'Café {"naïve": [1, 2.5e3, "日本"], "ok": true} — done'
    assert b"".join(vocab.token_bytes[t] for t in tok.encode(text)) == text.encode()
    assert vocab.token_bytes[tok.eos_token_id] is None and vocab.size == VOCAB


def test_every_byte_level_token_decodes_to_its_bytes():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from laneserve.engine.structured.vocab import _BYTE_DECODER

    assert {ch: b for b, ch in bytes_to_unicode().items()} == _BYTE_DECODER
    tok = tokenizer()
    vocab = token_vocabulary(tok)
    checked = 0
    for tid, b in enumerate(vocab.token_bytes):
        if b is None:
            assert tid in tok.all_special_ids
            continue
        try:
            text = b.decode()
        except UnicodeDecodeError:          # a lone byte of a multi-byte character
            continue
        assert tok.decode([tid]) == text
        checked += 1
    assert checked > VOCAB // 2


@functools.cache
def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: Metaspace ``▁`` for spaces, ``<0xNN>`` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(training_corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                                       show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>", unk_token="<unk>", bos_token="<s>")


def test_sentencepiece_style_tokenizer_is_constrained_correctly():
    tok = sentencepiece_tokenizer()
    vocab = token_vocabulary(tok)
    text = '{"x": "naïve é", "y": [1, 2]}'
    assert b"".join(vocab.token_bytes[t] for t in tok.encode(text)) == b" " + text.encode()
    for seed in range(10):
        out, _ = sample(StructuredSpec.json_schema(WEATHER), seed, tok=tok, vocab_size=len(tok))
        check_schema(json.loads(out), WEATHER)


def test_a_tokenizer_whose_decode_is_not_concatenation_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "{", "}", '"', ":", "a", "b", "1"]    # word-level, like the smoke model's
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="concatenation"):
        token_vocabulary(PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="</s>", unk_token="<unk>"))


def test_vocabulary_from_raw_token_bytes():
    token_bytes = [None, *(bytes([b]) for b in range(1, 128)), b"ab", b"abc"]
    vocab = TokenVocabulary(token_bytes, (0,))
    state = compile_constraint(StructuredSpec.regex("(abc)+"), vocab).new_state()
    state.advance(129)
    assert state.accepts() and state.allowed_mask(len(token_bytes))[0]


# ---- the OpenAI / vLLM request fields -----------------------------------------------------------
def test_request_fields_map_to_one_spec():
    from laneserve.server.structured import spec_from_request as closing

    def spec_from_request(body):        # the mapping alone (closing the objects is tested below)
        return closing(body, open_objects=True)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "ping"}}]
    assert spec_from_request({"prompt": "x"}) is None
    assert spec_from_request({"response_format": {"type": "text"}}) is None
    assert spec_from_request({"response_format": {"type": "json_object"}}) == StructuredSpec.json_object()
    assert spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": WEATHER, "strict": True}}}) == StructuredSpec.json_schema(WEATHER)
    assert spec_from_request({"guided_json": json.dumps(WEATHER)}) == StructuredSpec.json_schema(WEATHER)
    assert spec_from_request({"guided_regex": "[0-9]+"}) == StructuredSpec.regex("[0-9]+")
    assert spec_from_request({"structured_outputs": {"choice": ["a", "b"]}}) == StructuredSpec.choice(["a", "b"])
    assert spec_from_request({"tools": tools, "tool_choice": "auto"}) is None
    assert spec_from_request({"tools": tools, "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}}) == StructuredSpec.tool("get_weather", WEATHER)
    required = spec_from_request({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert required == StructuredSpec.tools_required([("get_weather", WEATHER), ("ping", None)], parallel=False)
    assert spec_from_request({"guided_grammar": 'root ::= "a"'}) == StructuredSpec.grammar('root ::= "a"')
    assert spec_from_request({"structured_outputs": {"grammar": "start: X"}}) == StructuredSpec.grammar("start: X")
    for bad in ({"guided_grammar": ""}, {"structured_outputs": {"grammar": 7}},
                {"guided_regex": "a", "response_format": {"type": "json_object"}},
                {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required"}, {"response_format": {"type": "xml"}}, {"guided_json": "{not json"}):
        with pytest.raises(UnsupportedSpec):
            spec_from_request(bad)


def test_tool_call_text_becomes_openai_tool_calls():
    from laneserve.server.structured import openai_tool_calls

    spec = StructuredSpec.tools_required([("get_weather", WEATHER), ("ping", None)])
    text, _ = sample(spec, seed=5)
    calls = openai_tool_calls(spec, text)
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    with pytest.raises(ValueError):
        openai_tool_calls(spec, text[:-3])                   # cut by max_tokens: not a complete call


def test_grammar_outputs_are_sentences_of_the_grammar():
    lark = StructuredSpec.grammar('start: ("yes" | "no") " " NUM ("," NUM)*\nNUM: /[0-9]{1,3}/')
    gbnf = StructuredSpec.grammar('root ::= "id-" [a-c]+ ("." [0-9])?')
    for seed in range(10):
        text, _ = sample(lark, seed)
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}(,[0-9]{1,3})*", text), text
        text, _ = sample(gbnf, seed)
        assert re.fullmatch(r"id-[a-c]+(\.[0-9])?", text), text


def test_object_schemas_are_closed_unless_asked_open():
    from laneserve.core.structured import close_objects
    from laneserve.server.structured import spec_from_request

    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "pets": {"type": "array", "items": {"properties": {"k": {}}}}},
              "allOf": [{"properties": {"a": {}}}], "$defs": {"d": {"type": "object"}}}
    closed = close_objects(person)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["pets"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]          # a part of one object stays open
    kept = {"type": "object", "additionalProperties": {"type": "integer"}, "patternProperties": {"^x": {}}}
    assert close_objects(kept) == kept
    body = {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    assert json.loads(spec_from_request(body).value)["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(spec_from_request(body, open_objects=True).value)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    spec = spec_from_request({"tools": tools, "tool_choice": "required"})
    assert json.loads(spec.value)["tools"][0]["parameters"]["additionalProperties"] is False


def test_required_tools_with_references_compile_and_generate():
    tree = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
            "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2,
                                                                         "items": {"$ref": "#/$defs/node"}}},
                               "required": ["kids"]}}}
    spec = StructuredSpec.tools_required([("plant", tree), ("ping", None)])
    schema = spec.json_schema_value()
    assert schema["$defs"]["tool0"]["properties"]["root"] == {"$ref": "#/$defs/tool0/$defs/node"}
    for seed in range(4):
        text, _ = sample(spec, seed)
        for call in parse_tool_calls(spec, text):
            assert call.name in ("plant", "ping") and isinstance(json.loads(call.arguments), dict)
