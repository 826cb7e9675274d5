"""Hostile structured-output and amplification requests, for the soak test, the hostile
structured-output benchmark and their tests: the schemas and regexes whose automata blow up
(nested bounded arrays, long ``maxLength``, ``(a|b)*a(a|b){N}``), keywords a grammar engine may
ignore (numeric ranges, ``uniqueItems``, formats, look-around), generated schemas and regexes,
and bodies that ask for huge responses or every admission slot.

Each case is ``(name, path, body)``; :func:`judge` says whether the server's answer is right: a
400, or a 200 whose document satisfies the constraint (checked with ``jsonschema``, or ``re``).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

NESTED_ARRAYS = {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {
    "type": "string", "maxLength": 200}, "maxItems": 200}, "maxItems": 200}, "maxItems": 200}
BOMB_SCHEMAS = [
    ("nested_arrays", NESTED_ARRAYS),
    ("max_length_20", {"type": "string", "maxLength": 20}),
    ("max_length_2000", {"type": "string", "maxLength": 2000}),
    ("int_range", {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["x"], "additionalProperties": False}),
    ("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("lookahead_pattern", {"type": "string", "pattern": "^(?=a)a+$"}),
    ("pattern_repeat", {"type": "string", "pattern": "^((a|b){40}){40}$"}),
    ("wide_object", {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,500}$"}
                                                      for i in range(300)}}),
]
BOMB_REGEXES = [("ab_tail_18", "(a|b)*a(a|b){18}"), ("ab_tail_40", "(a|b)*a(a|b){40}"),
                ("nested_counts", "((a|b){30}c){30}"), ("dot_64k", ".{0,65535}"),
                ("backreference", "(a)\\1"), ("word_boundary", "\\bword\\b")]
_FORMATS = ["date-time", "date", "email", "uuid", "ipv4", "hostname-ish"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema mixing enforced keywords with ones no grammar engine enforces."""
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object", "anyOf"]
                      if depth < 2 else ["string", "integer", "boolean", "enum"])
    if kind == "string":
        s: dict[str, Any] = {"type": "string"}
        pick = rng.random()
        if pick < 0.3:
            s["maxLength"] = rng.choice([3, 12, 60, 400, 5000])
        elif pick < 0.5:
            s["pattern"] = rng.choice(["^[a-c]{2,9}$", "^(ab|cd)*$", "[0-9]{3}", "^(?!x).*$", "(a|b)*a(a|b){12}"])
        elif pick < 0.65:
            s["format"] = rng.choice(_FORMATS)
        return s
    if kind == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.6:
            low = rng.randint(-50, 50)
            s.update(minimum=low, maximum=low + rng.choice([0, 5, 1000]))
        if rng.random() < 0.2:
            s["multipleOf"] = rng.choice([2, 7])
        return s
    if kind == "number":
        return {"type": "number", "minimum": rng.choice([-1.5, 0]), "exclusiveMaximum": rng.choice([2, 1e6])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["x", "y z", 1, None, True], rng.randint(1, 3))}
    if kind == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.choice([1, 3, 50, 400])}
        if rng.random() < 0.2:
            s[rng.choice(["uniqueItems", "contains"])] = True if rng.random() < 0.5 else {"type": "integer"}
        return s
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    s = {"type": "object", "properties": props, "required": sorted(rng.sample(sorted(props), rng.randint(0, len(props)))),
         "additionalProperties": False}
    if rng.random() < 0.15:
        s[rng.choice(["propertyNames", "dependentRequired", "minProperties"])] = (
            {"maxLength": 3} if rng.random() < 0.4 else 1)
    return s


def random_regex(rng: random.Random) -> str:
    atoms = ["a", "b", "[0-9]", "(a|b)", "(ab|ba)", "[a-c]", "(x?)"]
    parts = []
    for _ in range(rng.randint(1, 5)):
        atom = rng.choice(atoms)
        parts.append(atom + rng.choice(["", "*", "+", "{%d}" % rng.randint(1, 30), "{1,%d}" % rng.randint(2, 60)]))
    return "".join(parts)


# constraints that cannot run and must be refused before admission (a 400, never an instance's 500):
# self-referencing schemas and grammars, grammars past the grammar engine's per-step limits,
# sampling constraints that contradict the structured output
MUST_REFUSE = [
    ("ref_root", {"guided_json": {"$ref": "#"}}),
    ("ref_cycle", {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}}),
    ("lark_json_ref_root", {"guided_grammar": 'start: %json {"$ref": "#"}'}),
    ("a_times_1e6", {"guided_grammar": 'start: "a"{1000000}'}),
    ("doubling_chain_60", {"guided_grammar": "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1}" for i in range(60))
                           + '\nr60: "a"'}),
    ("gbnf_5000_alternatives", {"guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(5000))}),
    ("allowed_vs_regex", {"guided_regex": "[0-9]+", "allowed_token_ids": [5, 6]}),
]


def structured_cases(rng: random.Random, generated: int = 40) -> list[tuple[str, str, dict]]:
    """The bomb list, the constraints that must be refused (``refuse:NAME``), then ``generated``
    random schemas and regexes, as chat requests."""
    out = [(f"refuse:{name}", "/v1/chat/completions", fields) for name, fields in MUST_REFUSE]
    for name, schema in BOMB_SCHEMAS:
        out.append((f"schema:{name}", "/v1/chat/completions", {"response_format": {
            "type": "json_schema", "json_schema": {"name": name, "schema": schema}}}))
    for name, pattern in BOMB_REGEXES:
        out.append((f"regex:{name}", "/v1/chat/completions", {"guided_regex": pattern}))
    for i in range(generated):
        if i % 3 == 2:
            out.append((f"regex:gen{i}", "/v1/chat/completions", {"guided_regex": random_regex(rng)}))
        else:
            schema = random_schema(rng)
            out.append((f"schema:gen{i}", "/v1/chat/completions", {"guided_json": schema}))
    return out


def chat_body(model: str, fields: dict, max_tokens: int = 48, seed: int = 0) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "answer"}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, **fields}


def amplification_body(model: str) -> dict:
    """echo + top-20 logprobs + top-20 prompt logprobs over 40 prompts of 4,000 token ids."""
    return {"model": model, "prompt": [[(i * 7 + k) % 1000 + 3 for k in range(4000)] for i in range(40)],
            "max_tokens": 16, "echo": True, "logprobs": 20, "prompt_logprobs": 20}


def slot_hog_body(model: str) -> dict:
    return {"model": model, "prompt": ["a", "b"], "best_of": 128, "max_tokens": 4000}


def judge(fields: dict, status: int, body: Any) -> str:
    """``"refused"`` (a 400), ``"valid"`` (a finished document satisfying the constraint),
    ``"cut"`` (a 200 that hit max_tokens: no complete document to check) or ``"wrong: ..."``."""
    if status == 400:
        return "refused"
    if status != 200:
        return f"wrong: status {status}"
    if any(fields == f for _, f in MUST_REFUSE):
        return "wrong: a constraint that cannot run was admitted"
    choice = body["choices"][0]
    if choice.get("finish_reason") == "length":
        return "cut"
    text = choice["message"]["content"]
    if "guided_regex" in fields:
        return "valid" if re.fullmatch(fields["guided_regex"], text) else f"wrong: {text!r} !~ {fields['guided_regex']}"
    schema = fields.get("guided_json") or fields["response_format"]["json_schema"]["schema"]
    import jsonschema

    try:
        doc = json.loads(text)
    except ValueError:
        return f"wrong: not JSON: {text[:80]!r}"
    cls = jsonschema.validators.validator_for(schema)
    errors = [e.message for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(doc)]
    return "valid" if not errors else f"wrong: {errors[0][:120]}"
