"""The OpenAI and vLLM request fields that ask for structured output, mapped to one
:class:`StructuredSpec`, and the text of a tool-call request mapped back to OpenAI ``tool_calls``.
Pure Python: the API process calls these on the request body.

Fields read (at most one constraint per request, else :class:`UnsupportedSpec`):

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- vLLM's extension fields ``guided_json`` (a schema, dict or JSON string), ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` (Lark, or GBNF converted to Lark), and
  the newer ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}``;
- ``tools`` with ``tool_choice``: ``{"type": "function", "function": {"name": N}}`` constrains the
  output to N's arguments, ``"required"`` to a JSON array of calls (one call when
  ``parallel_tool_calls`` is false); ``"auto"``/``"none"``/absent constrain nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from laneserve.core.structured import StructuredSpec, ToolCall, UnsupportedSpec, json_text, parse_tool_calls


def spec_from_request(body: Mapping[str, Any], *, open_objects: bool = False) -> StructuredSpec | None:
    """The structured-output constraint a completion or chat-completion request asks for. Object
    schemas that say nothing of further keys are closed (vLLM's default), unless ``open_objects``
    (JSON Schema's own reading: any further key allowed)."""
    spec = _spec(body)
    return spec if spec is None or open_objects else spec.closed()


def _spec(body: Mapping[str, Any]) -> StructuredSpec | None:
    found: list[tuple[str, StructuredSpec]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    for field, make in (("guided_json", lambda v: StructuredSpec.json_schema(_schema(v, "guided_json"))),
                        ("guided_regex", StructuredSpec.regex), ("guided_choice", StructuredSpec.choice),
                        ("guided_grammar", StructuredSpec.grammar)):
        if body.get(field) is not None:
            found.append((field, make(body[field])))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise UnsupportedSpec("structured_outputs must be an object")
        for key, make in (("json", lambda v: StructuredSpec.json_schema(_schema(v, "structured_outputs.json"))),
                          ("regex", StructuredSpec.regex), ("choice", StructuredSpec.choice),
                          ("grammar", StructuredSpec.grammar)):
            if outputs.get(key) is not None:
                found.append((f"structured_outputs.{key}", make(outputs[key])))
        if outputs.get("json_object"):
            found.append(("structured_outputs.json_object", StructuredSpec.json_object()))
    tool_spec = _tool_choice(body)
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    if len(found) > 1:
        raise UnsupportedSpec("only one structured-output constraint per request, got "
                              + ", ".join(name for name, _ in found))
    return found[0][1] if found else None


def openai_tool_calls(spec: StructuredSpec, text: str) -> list[dict[str, Any]]:
    """The ``tool_calls`` of the assistant message for a finished ``tool``/``tools_required``
    request (``ValueError`` if ``text`` is not complete: the request hit its token limit)."""
    return [_tool_call_json(call) for call in parse_tool_calls(spec, text)]


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish_reason(spec: StructuredSpec) -> str:
    """The finish reason of a completed tool call, as OpenAI's API and vLLM (streamed or not):
    ``"stop"`` for a function named by ``tool_choice``, ``"tool_calls"`` for ``"required"``."""
    return "tool_calls" if spec.kind == "tools_required" else "stop"


class ToolCallStream:
    """The streamed text of one choice of a tool-call request as OpenAI ``delta.tool_calls``.

    A named function (``tool``): the text is the arguments object, so the first delta carries the
    call's id, type, name and the first piece of the arguments, each later delta the next piece.
    ``"required"`` (``tools_required``): the text is a JSON array of ``{"name", "arguments"}``
    objects; a call is sent, whole, in the delta where its object closes (a call's name is only
    known once its object has been read)."""

    def __init__(self, spec: StructuredSpec) -> None:
        self.spec = spec
        self.name = json.loads(spec.value)["name"] if spec.kind == "tool" else None
        self.text = ""
        self.pos = 0                        # tools_required: where the next call's object may start
        self.calls = 0

    def delta(self, text: str) -> dict[str, Any]:
        if self.spec.kind == "tool":
            first = self.calls == 0
            self.calls = 1
            if first:
                return {"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                        "function": {"name": self.name, "arguments": text}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        self.text += text
        out = []
        decoder = json.JSONDecoder()
        while True:
            start = self.pos
            while start < len(self.text) and self.text[start] in "[, \t\n\r":
                start += 1
            if start >= len(self.text) or self.text[start] != "{":
                break
            try:
                call, end = decoder.raw_decode(self.text, start)
            except ValueError:                  # the object is not complete yet
                break
            self.pos = end
            out.append({"index": self.calls, "id": call_id(), "type": "function",
                        "function": {"name": call["name"],
                                     "arguments": json_text(call["arguments"])}})
            self.calls += 1
        return {"tool_calls": out} if out else {}


def _response_format(fmt: Any) -> StructuredSpec | None:
    if not isinstance(fmt, Mapping):
        raise UnsupportedSpec("response_format must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, Mapping):
            raise UnsupportedSpec("response_format.json_schema must be an object")
        schema = inner.get("schema")
        # OpenAI allows a json_schema format without a schema: any JSON object then
        return StructuredSpec.json_object() if schema is None else StructuredSpec.json_schema(
            _schema(schema, "response_format.json_schema.schema"))
    raise UnsupportedSpec(f"unknown response_format type {kind!r}")


def _tool_choice(body: Mapping[str, Any]) -> StructuredSpec | None:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    tools = _tools(body.get("tools"))
    if choice == "required":
        parallel = body.get("parallel_tool_calls")
        return StructuredSpec.tools_required(list(tools.items()), parallel=parallel is not False)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in tools:
            raise UnsupportedSpec(f"tool_choice names {name!r}, which is not among the tools")
        return StructuredSpec.tool(name, tools[name])
    raise UnsupportedSpec(f"unsupported tool_choice {choice!r}")


def _tools(tools: Any) -> dict[str, Mapping[str, Any] | None]:
    if not isinstance(tools, list) or not tools:
        raise UnsupportedSpec("tool_choice needs a non-empty tools list")
    out: dict[str, Mapping[str, Any] | None] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise UnsupportedSpec("each tool must be {'type': 'function', 'function': {'name': ..., ...}}")
        params = fn.get("parameters")
        out[fn["name"]] = None if params is None else _schema(params, f"tools[{fn['name']}].parameters")
    return out


def _schema(value: Any, what: str) -> Mapping[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise UnsupportedSpec(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise UnsupportedSpec(f"{what} must be a JSON schema object")
    return value
