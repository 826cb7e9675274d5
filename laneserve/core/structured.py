"""What a structured-output request asks for, as a hashable value, and the regular expression that
says which texts satisfy it (issue 14, item 3). Pure Python (no torch): ``SamplingParams`` can
carry a spec and the API process can build and check one; the engine compiles it
(``laneserve.engine.structured``). ``to_regex`` needs ``outlines_core`` (the engine extra).

A :class:`StructuredSpec` is two strings (``kind``, ``value``), so it is a cache key, fits the wire
between the API server and the instances, and compiles the same way in every process. Kinds:

==================  ==========================================  ==========================================
kind                value                                       the text the model must produce
==================  ==========================================  ==========================================
``json_object``     ``""``                                      any JSON object, containers nested <= 2 deep
``json_schema``     the schema as JSON (key order kept)         JSON valid against the schema (see below)
``regex``           the pattern                                 a full match of the pattern
``choice``          JSON list of the options                    exactly one option, verbatim (not quoted)
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
OpenAI ``tool_calls`` list. JSON texts use at most one space between tokens and no newlines
(outlines-core's default whitespace pattern), which also keeps a noisy model from padding forever.

Schemas go through ``outlines_core.json_schema.build_regex_from_schema``: ``not`` and
``if``/``then`` are rejected; numeric bounds (``minimum``, ``multipleOf``...), ``uniqueItems``,
``patternProperties``, ``minProperties`` and ``dependentRequired`` are accepted but NOT enforced;
object properties appear in the schema's order; recursive schemas are unrolled to depth 3.
Context-free grammars (vLLM's ``guided_grammar``) are not supported: outlines-core compiles only
regular languages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# containers nest at most this deep in json_object mode: outlines-core's own "any object" regex
# (depth 3) becomes a 1,623-state DFA that takes seconds to compile even for a 1,024-token
# vocabulary, about 40x longer than depth 2 (401 states; benchmarks/structured_output.py)
JSON_OBJECT_DEPTH = 2
KINDS = ("json_object", "json_schema", "regex", "choice", "tool", "tools_required")
_WS = "[ ]?"                       # outlines-core's default JSON whitespace: at most one space
_REGEX_LITERAL_SAFE = set("<>")    # escaping these means a word boundary in the regex engine


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
    def to_regex(self) -> str:
        """The regular expression whose full matches are exactly the allowed outputs."""
        if self.kind == "regex":
            return self.value
        if self.kind == "choice":
            return "(" + "|".join(escape_regex(o) for o in json.loads(self.value)) + ")"
        if self.kind == "json_object":
            return json_object_regex(JSON_OBJECT_DEPTH)
        if self.kind == "json_schema":
            return _schema_regex(json.loads(self.value))
        if self.kind == "tool":
            return _schema_regex(json.loads(self.value)["parameters"])
        spec = json.loads(self.value)
        call = "(" + "|".join(_call_regex(t["name"], t["parameters"]) for t in spec["tools"]) + ")"
        more = f"({_WS},{_WS}{call})*" if spec["parallel"] else ""
        return rf"\[{_WS}{call}{more}{_WS}\]"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str      # a JSON object, as OpenAI's ``function.arguments`` carries it


def parse_tool_calls(spec: StructuredSpec, text: str) -> list[ToolCall]:
    """The calls in the complete output ``text`` of a ``tool``/``tools_required`` request. Raises
    ``ValueError`` when the text is not a complete call (the request hit ``max_tokens``)."""
    if spec.kind == "tool":
        args = json.loads(text)
        if not isinstance(args, dict):
            raise ValueError("tool arguments must be a JSON object")
        return [ToolCall(json.loads(spec.value)["name"], json.dumps(args, ensure_ascii=False))]
    if spec.kind != "tools_required":
        raise ValueError(f"a {spec.kind!r} request carries no tool calls")
    calls = json.loads(text)
    if not isinstance(calls, list) or not calls:
        raise ValueError("tool calls must be a non-empty JSON array")
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def escape_regex(literal: str) -> str:
    """``literal`` as a regex matching exactly it (the regex engine is Rust's, not Python's ``re``)."""
    return "".join("\\" + ch if ch.isascii() and not ch.isalnum() and ch.isprintable() and ch != "_"
                   and ch not in _REGEX_LITERAL_SAFE else ch for ch in literal)


def json_object_regex(depth: int) -> str:
    """Any JSON object whose objects and arrays nest at most ``depth`` levels (the top one included)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING

    value = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    obj = value
    for _ in range(depth):
        obj = rf"\{{{_WS}({STRING}{_WS}:{_WS}{value}({_WS},{_WS}{STRING}{_WS}:{_WS}{value})*)?{_WS}\}}"
        array = rf"\[{_WS}({value}({_WS},{_WS}{value})*)?{_WS}\]"
        value = f"({value}|{array}|{obj})"
    return obj


def _schema_regex(schema: Any) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(json.dumps(schema), _WS)
    except (ValueError, TypeError) as exc:          # outlines-core reports unsupported structure
        raise UnsupportedSpec(f"unsupported JSON schema: {str(exc).splitlines()[0]}") from exc


def _call_regex(name: str, parameters: Any) -> str:
    return (rf"\{{{_WS}\"name\"{_WS}:{_WS}{escape_regex(json.dumps(name, ensure_ascii=False))}{_WS},"
            rf"{_WS}\"arguments\"{_WS}:{_WS}({_schema_regex(parameters)}){_WS}\}}")


def _canonical(obj: Any, what: str) -> str:
    if not isinstance(obj, Mapping):
        raise UnsupportedSpec(f"{what} must be a JSON object")
    try:
        # keys keep their order: outlines-core emits object properties in the schema's order
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedSpec(f"{what} is not valid JSON: {exc}") from exc


def _tool_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise UnsupportedSpec("a tool needs a non-empty string name")
    return name


def _parameters(parameters: Mapping[str, Any] | None) -> Mapping[str, Any]:
    # OpenAI: a function without parameters takes an empty object
    return parameters if parameters is not None else {"type": "object", "properties": {}}
