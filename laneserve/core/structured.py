"""What a structured-output request asks for, as a hashable value, and the grammar that says which
texts satisfy it. Pure Python (no torch): ``SamplingParams`` can carry a spec and the API process
can build and check one; the engine enforces it (``laneserve.engine.structured``). ``to_grammar``
needs ``llguidance`` (the engine extra).

A :class:`StructuredSpec` is two strings (``kind``, ``value``), so it is a cache key, fits the wire
between the API server and the instances, and compiles the same way in every process. Kinds:

==================  ==========================================  ==========================================
kind                value                                       the text the model must produce
==================  ==========================================  ==========================================
``json_object``     ``""``                                      any JSON object
``json_schema``     the schema as JSON (key order kept)         JSON valid against the schema (see below)
``regex``           the pattern                                 a full match of the pattern
``choice``          JSON list of the options                    exactly one option, verbatim (not quoted)
``grammar``         a Lark grammar (GBNF is converted)          a sentence of the grammar
``tool``            ``{"name", "parameters"}`` as JSON          the function's arguments: a JSON object
                                                                valid against ``parameters``
``tools_required``  ``{"tools": [...], "parallel": bool}``      ``[{"name": N, "arguments": {...}}, ...]``:
                                                                one call (or, with ``parallel``, one or
                                                                more), each N one of the tools' names and
                                                                its arguments valid against that tool's
                                                                ``parameters``
==================  ==========================================  ==========================================

:func:`parse_tool_calls` turns the text a ``tool``/``tools_required`` request produced into
:class:`ToolCall` values (name + the arguments as a JSON string), which the server wraps as the
OpenAI ``tool_calls`` list. JSON texts use at most one space between tokens and no newlines,
which also keeps a noisy model from padding forever.

Grammars are llguidance's (``docs/structured_output.md``): a lazy lexer and an Earley parser, so
no automaton is built up front and nothing grows with ``maxLength`` or a counted repetition. Every
JSON-schema keyword is either enforced or refused: llguidance rejects the keywords it does not
implement (``uniqueItems``, ``contains``, ``not``, ``if``/``then``, ``dependentRequired``,
``propertyNames``, ``unevaluatedProperties``...), unknown ``format`` names and regex features it
cannot match (look-around, back-references), and those refusals become a 400 naming the keyword.
Numeric bounds, ``multipleOf``, string lengths and patterns, ``minProperties``/``maxProperties``,
``prefixItems`` and the common formats are enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool", "tools_required")
# JSON whitespace: at most one space between tokens (no newlines, no runs of spaces)
JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}
_REGEX_LITERAL_SAFE = set("<>")    # escaping these means a word boundary in Rust's regex syntax
# schema keywords whose value changes nothing (jsonschema agrees), dropped before compiling: the
# grammar engine refuses the keyword whatever its value
_NO_OP_KEYWORDS = {"uniqueItems": False}


class UnsupportedSpec(ValueError):
    """The request asks for a constraint that cannot be compiled (bad schema, unsupported feature)."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedSpec(f"unknown structured-output kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not isinstance(self.value, str):
            raise UnsupportedSpec(f"structured-output value must be a string, got {type(self.value).__name__}")

    # ---- constructors (the API's fields map onto these) ----------------------------------------
    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> StructuredSpec:
        return cls("json_schema", _canonical(schema, "schema"))

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        if not isinstance(pattern, str) or not pattern:
            raise UnsupportedSpec("regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredSpec:
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise UnsupportedSpec("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> StructuredSpec:
        """A context-free grammar: Lark syntax (llguidance's, as vLLM's ``guidance`` backend takes
        it) or GBNF (``root ::= ...``, xgrammar's and llama.cpp's), converted to Lark."""
        if not isinstance(text, str) or not text.strip():
            raise UnsupportedSpec("grammar must be a non-empty string")
        return cls("grammar", text)

    @classmethod
    def tool(cls, name: str, parameters: Mapping[str, Any] | None) -> StructuredSpec:
        """``tool_choice`` naming a function: the output is that function's arguments object."""
        return cls("tool", _canonical({"name": _tool_name(name), "parameters": _parameters(parameters)}, "tool"))

    @classmethod
    def tools_required(cls, tools: Sequence[tuple[str, Mapping[str, Any] | None]], *,
                       parallel: bool = True) -> StructuredSpec:
        """``tool_choice="required"`` over ``tools`` given as ``(name, parameters)`` pairs."""
        if not tools:
            raise UnsupportedSpec("tool_choice 'required' needs at least one tool")
        entries = [{"name": _tool_name(n), "parameters": _parameters(p)} for n, p in tools]
        return cls("tools_required", _canonical({"tools": entries, "parallel": bool(parallel)}, "tools"))

    # ---- what it compiles to -------------------------------------------------------------------
    def to_grammar(self) -> str:
        """The llguidance grammar (serialised) whose sentences are exactly the allowed outputs.
        Nothing is compiled here: the grammar is checked and built lazily by a matcher."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("(" + "|".join(escape_regex(o) for o in json.loads(self.value)) + ")")
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(_lark(self.value))
        return _schema_grammar(self.json_schema_value())

    def json_schema_value(self) -> Any:
        """The JSON schema a JSON-producing spec stands for (``json_object``: any object)."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind == "json_schema":
            return json.loads(self.value)
        if self.kind == "tool":
            return json.loads(self.value)["parameters"]
        if self.kind == "tools_required":
            spec = json.loads(self.value)
            defs: dict[str, Any] = {}
            calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                       "arguments": _hoisted(t["parameters"], f"tool{i}", defs)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for i, t in enumerate(spec["tools"])]
            array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                     "minItems": 1}
            if defs:
                array["$defs"] = defs
            if not spec["parallel"]:
                array["maxItems"] = 1
            return array
        raise UnsupportedSpec(f"a {self.kind!r} constraint is not a JSON schema")


    def closed(self) -> StructuredSpec:
        """This spec with every object schema that says nothing of further keys closed
        (``additionalProperties: false``), as vLLM's default grammar backend treats them: a
        client that leaves it out (pydantic's ``model_json_schema()``, LangChain's tools) gets no
        invented keys. Other kinds are returned as they are."""
        if self.kind == "json_schema":
            return StructuredSpec("json_schema", _canonical(close_objects(json.loads(self.value)), "schema"))
        if self.kind == "tool":
            value = json.loads(self.value)
            return StructuredSpec("tool", _canonical({**value, "parameters": close_objects(value["parameters"])},
                                                     "tool"))
        if self.kind == "tools_required":
            value = json.loads(self.value)
            tools = [{**t, "parameters": close_objects(t["parameters"])} for t in value["tools"]]
            return StructuredSpec("tools_required", _canonical({**value, "tools": tools}, "tools"))
        return self


_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any, *, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` added to each object schema (``type``
    object or ``properties``) that sets none of additionalProperties, patternProperties and
    unevaluatedProperties. The direct members of an ``allOf`` stay open (each describes part of
    one object; closing them would contradict one another)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: close_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [close_objects(sub, in_all_of=key == "allOf") for sub in value]
        elif key in _SCHEMA_VALUES:
            value = close_objects(value)
        out[key] = value
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and not in_all_of and not any(k in schema for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


def _hoisted(parameters: Any, name: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters placed inside a larger schema: a schema with references (``#``,
    ``#/$defs/...``, which point at its own root) moves to ``defs[name]``, its references
    rewritten to point there, and a reference to it takes its place."""
    if not isinstance(parameters, dict) or '"$ref"' not in json.dumps(parameters):
        return parameters
    defs[name] = _rebased(parameters, f"#/$defs/{name}")
    return {"$ref": f"#/$defs/{name}"}


def _rebased(schema: Any, base: str) -> Any:
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            value = base + value[1:]
        elif key not in ("const", "enum", "default", "examples"):
            value = _rebased(value, base)
        out[key] = value
    return out


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str      # a JSON object, as OpenAI's ``function.arguments`` carries it


def parse_tool_calls(spec: StructuredSpec, text: str) -> list[ToolCall]:
    """The calls in the complete output ``text`` of a ``tool``/``tools_required`` request. Raises
    ``ValueError`` when the text is not a complete call (the request hit ``max_tokens``)."""
    if spec.kind == "tool":
        args = loads_strict(text)
        if not isinstance(args, dict):
            raise ValueError("tool arguments must be a JSON object")
        return [ToolCall(json.loads(spec.value)["name"], json_text(args))]
    if spec.kind != "tools_required":
        raise ValueError(f"a {spec.kind!r} request carries no tool calls")
    calls = loads_strict(text)
    if not isinstance(calls, list) or not calls:
        raise ValueError("tool calls must be a non-empty JSON array")
    return [ToolCall(c["name"], json_text(c["arguments"])) for c in calls]


def json_text(value: Any) -> str:
    """``value`` as JSON text that encodes as UTF-8: non-ASCII kept, but a lone surrogate (which a
    ``\\ud800`` escape in a model's output decodes to) written back as its escape, not as a
    character no UTF-8 encoder takes. A number too large for a double (a JSON literal such as
    ``1e999`` parses to infinity) is written ``1e999``, not as the ``Infinity`` no JSON parser
    reads; NaN (which no JSON text parses to) is refused (``ValueError``)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = _FINITE.sub(_finite, json.dumps(value, ensure_ascii=False))
        if "NaN" in _FINITE.sub("", text):
            raise ValueError("NaN is not JSON") from None
    return text if text.isascii() or not _SURROGATE.search(text) else json_text_ascii(text)


def json_text_ascii(text: str) -> str:
    """JSON ``text`` with every non-ASCII character escaped (lone surrogates included)."""
    return _NON_ASCII.sub(lambda m: json.dumps(m.group(0))[1:-1], text)


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON string (kept as it is) or a bare infinity written by json.dumps
_FINITE = re.compile(r'"(?:[^"\\]|\\.)*"|(-?)Infinity')


def _finite(m: re.Match) -> str:
    return m.group(0) if m.group(0).startswith('"') else m.group(1) + "1e999"


def loads_strict(text: str) -> Any:
    """JSON text parsed as JSON (RFC 8259): ``NaN``, ``Infinity`` and ``-Infinity`` are refused
    (Python's ``json`` takes them; a client's JSON parser would then fail on what is sent)."""
    return json.loads(text, parse_constant=no_json_constant)


def no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def escape_regex(literal: str) -> str:
    """``literal`` as a regex matching exactly it (the regex engine is Rust's, not Python's ``re``)."""
    return "".join("\\" + ch if ch.isascii() and not ch.isalnum() and ch.isprintable() and ch != "_"
                   and ch not in _REGEX_LITERAL_SAFE else ch for ch in literal)


def _schema_grammar(schema: Any) -> str:
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(_without_no_ops(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise UnsupportedSpec(f"invalid JSON schema: {str(exc).splitlines()[0]}") from exc


def _without_no_ops(schema: Any) -> Any:
    """``schema`` without keywords whose value constrains nothing (``uniqueItems: false``), at every
    schema position (not inside ``properties`` maps, whose keys are property names)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _NO_OP_KEYWORDS and value == _NO_OP_KEYWORDS[key]:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _without_no_ops(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_without_no_ops(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            value = _without_no_ops(value)
        out[key] = value
    return out


_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LISTS = {"anyOf", "allOf", "oneOf", "prefixItems"}
_SCHEMA_VALUES = {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "additionalItems", "unevaluatedItems", "unevaluatedProperties"}


def _lark(text: str) -> str:
    """Lark text; GBNF (``root ::= ...``) converted by llguidance's own translator."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the translator raises plain exceptions on bad input
        raise UnsupportedSpec(f"cannot read the grammar: {' '.join(str(exc).split())[:200]}") from exc


def _canonical(obj: Any, what: str) -> str:
    if not isinstance(obj, Mapping):
        raise UnsupportedSpec(f"{what} must be a JSON object")
    try:
        # keys keep their order: the grammar emits object properties in the schema's order
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedSpec(f"{what} is not valid JSON: {exc}") from exc


def _tool_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise UnsupportedSpec("a tool needs a non-empty string name")
    return name


def _parameters(parameters: Mapping[str, Any] | None) -> Mapping[str, Any]:
    # OpenAI: a function without parameters takes an empty object
    return parameters if parameters is not None else {"type": "object", "properties": {}, "additionalProperties": False}
