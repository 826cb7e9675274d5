"""Every JSON-schema keyword is enforced or refused: generated schemas (keywords the grammar engine
enforces mixed with ones it cannot) are either refused with a message naming the keyword, or
every document sampled under them from random logits validates against the schema with a real
validator (``jsonschema``, formats checked)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laneserve.engine.structured import StructuredSpec, UnsupportedSpec, apply, compile_constraint
from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer
from structured_support import validating

VOCAB = 512
MAX_STEPS = 1500
# keywords the grammar engine cannot enforce: a schema holding one must be refused
REFUSED = {"uniqueItems", "contains", "not", "if", "dependentRequired", "propertyNames"}
FORMATS = ["date-time", "date", "time", "email", "uuid", "ipv4"]


@functools.cache
def tokenizer():
    return byte_level_tokenizer(VOCAB)


@functools.cache
def closing_bias() -> torch.Tensor:
    """+4 on tokens that close a string, array or object (and EOS): documents end in a few hundred
    tokens instead of wandering; the mask still decides what is allowed."""
    tok = tokenizer()
    bias = torch.zeros(VOCAB)
    for tid in range(VOCAB):
        text = tok.decode([tid])
        if any(c in text for c in '"]}') or tid == tok.eos_token_id:
            bias[tid] = 4.0
    return bias


def strings():
    base = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 3), "maxLength": st.integers(3, 8),
        "pattern": st.sampled_from(["^[a-c]+$", "[0-9]{2}", "^x", "^(ab|cd)*$", "e$"])})
    return st.one_of(base, st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(FORMATS)))


def numbers():
    integer = st.fixed_dictionaries({"type": st.just("integer")}, optional={
        "minimum": st.integers(-20, 5), "maximum": st.integers(6, 300), "exclusiveMinimum": st.integers(-30, -21),
        "multipleOf": st.sampled_from([2, 3, 5])})
    number = st.fixed_dictionaries({"type": st.just("number")}, optional={
        "minimum": st.sampled_from([-1.5, 0, 2]), "maximum": st.sampled_from([3, 10.25, 1000])})
    return st.one_of(integer, number)


def leaves():
    return st.one_of(strings(), numbers(), st.just({"type": "boolean"}), st.just({"type": "null"}),
                     st.builds(lambda v: {"enum": v}, st.lists(st.sampled_from([1, "a", None, True, "b c"]),
                                                               min_size=1, max_size=3, unique=True)),
                     st.builds(lambda v: {"const": v}, st.sampled_from([0, "k", [1, 2], {"x": 1}])))


def containers(children):
    names = st.sampled_from(["a", "b", "c", "id", "name"])
    array = st.fixed_dictionaries({"type": st.just("array"), "items": children}, optional={
        "minItems": st.integers(0, 2), "maxItems": st.integers(2, 4), "uniqueItems": st.just(True),
        "contains": children})
    obj = st.builds(_object, st.dictionaries(names, children, min_size=1, max_size=3), st.data())
    combined = st.one_of(
        st.builds(lambda s: {"anyOf": s}, st.lists(children, min_size=2, max_size=2)),
        st.builds(lambda s: {"allOf": [s, {}]}, children),
        st.builds(lambda s: {"not": s}, children),
        st.builds(lambda s: {"if": s, "then": {"type": "string"}}, children))
    return st.one_of(array, obj, combined)


def _object(props: dict, data) -> dict:
    schema: dict = {"type": "object", "properties": props}
    keys = sorted(props)
    schema["required"] = data.draw(st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)))
    schema["additionalProperties"] = data.draw(st.sampled_from([False, True, {"type": "integer"}]))
    extra = data.draw(st.sampled_from(["", "minProperties", "maxProperties", "patternProperties",
                                       "propertyNames", "dependentRequired"]))
    if extra == "minProperties":
        schema["minProperties"] = 1
    elif extra == "maxProperties":
        schema["maxProperties"] = len(keys) + 1
    elif extra == "patternProperties":
        schema["patternProperties"] = {"^z": {"type": "boolean"}}
    elif extra == "propertyNames":
        schema["propertyNames"] = {"maxLength": 4}
    elif extra == "dependentRequired":
        schema["dependentRequired"] = {keys[0]: keys}
    return schema


SCHEMAS = st.recursive(leaves(), containers, max_leaves=5)


def keywords(schema) -> set[str]:
    out: set[str] = set()
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k != "properties" and k != "patternProperties":
                out.add(k)
            out |= keywords(v) if k not in ("properties", "patternProperties") else set().union(
                *(keywords(s) for s in v.values()))
    elif isinstance(schema, list):
        for v in schema:
            out |= keywords(v)
    return out


def sample_document(spec: StructuredSpec, seed: int) -> str | None:
    """Random logits (a random-weight model) with a pull towards closing, masked, until EOS."""
    tok = tokenizer()
    state = compile_constraint(spec, tok).new_state()
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not state.is_terminated():
        if len(out) >= MAX_STEPS:
            return None
        logits = torch.randn(1, VOCAB, generator=gen) * 2 + closing_bias()
        apply(logits, [state])
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        state.advance(token)
        out.append(token)
    return tok.decode(out, skip_special_tokens=True)


VALIDATED: list[int] = []


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=SCHEMAS)
def test_generated_schemas_are_enforced_or_refused(schema):
    type(validating(schema)).check_schema(schema)
    spec = StructuredSpec.json_schema(schema)
    refused_keys = keywords(schema) & REFUSED
    try:
        compile_constraint(spec, tokenizer())
    except UnsupportedSpec as exc:
        # refused: only for a keyword (or value) that cannot be enforced, and the message says which
        assert refused_keys, f"refused a schema with no unenforceable keyword: {exc}\n{json.dumps(schema)}"
        assert any(k in str(exc) for k in refused_keys), str(exc)
        return
    assert not refused_keys, f"accepted {refused_keys}, which the engine cannot enforce: {json.dumps(schema)}"
    validator = validating(schema)
    for seed in range(3):
        text = sample_document(spec, seed)
        if text is None:
            continue
        doc = json.loads(text)
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, f"{text!r} violates {json.dumps(schema)}: {errors[:3]}"
        VALIDATED.append(1)


def test_the_generated_schemas_produced_validated_documents():
    """Runs after the property test (same module, file order): it must not pass vacuously."""
    if not VALIDATED:
        pytest.skip("run together with test_generated_schemas_are_enforced_or_refused")
    assert len(VALIDATED) >= 40


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
    {"type": "number", "minimum": -2.5, "maximum": 0.5},
    {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 100},
    {"type": "string", "pattern": "^[0-9]{3}-[a-c]{2}$"},
    {"type": "object", "minProperties": 2, "additionalProperties": {"type": "boolean"}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}], "items": False},
])
def test_numeric_ranges_and_other_keywords_are_enforced(schema):
    spec = StructuredSpec.json_schema(schema)
    validator = validating(schema)
    done = 0
    for seed in range(8):
        text = sample_document(spec, seed)
        if text is not None:
            assert validator.is_valid(json.loads(text)), f"{text!r} violates {schema}"
            done += 1
    assert done >= 6
