"""Automatic tool-call parsing (``--enable-auto-tool-choice --tool-call-parser NAME``): the text a
model writes when it decides to call a tool, turned into OpenAI ``tool_calls``.

Applied to chat requests that carry ``tools`` with ``tool_choice`` ``"auto"`` (or absent). Nothing
constrains the model here: it writes free text, and the parser looks for its family's tool-call
format afterwards. Text that holds no well-formed call is returned as plain content, unchanged.

Parsers (the names vLLM's ``--tool-call-parser`` uses):

``hermes`` (also ``qwen``, ``qwen2_5``)
    Hermes 2 Pro, Qwen2.5 and Qwen3: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
    the content is the text before the first ``<tool_call>``.
``llama3_json`` (also ``llama``, ``llama4_json``)
    Llama 3.1 / 3.2 JSON-based tool calling: the whole output is one or more objects
    ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is accepted too), optionally after
    ``<|python_tag|>`` and separated by ``;``. No content beside them.
``mistral``
    ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects, or by
    ``name[ARGS]{...}`` / ``name{...}`` pairs (newer Mistral tokenizers); call ids are nine
    alphanumeric characters, as Mistral's chat templates require.

Streaming (:class:`AutoToolStream`): text is sent as ``delta.content`` until a tool-call start
marker appears (a suffix that may be the start of a marker is held back); from the marker on the
text is buffered and, when the choice finishes, sent as ``delta.tool_calls`` (one entry per call,
complete) — or as content if it did not hold a well-formed call.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

from laneserve.core.structured import no_json_constant, json_text, loads_strict

__all__ = ["PARSERS", "AutoToolStream", "ParsedCalls", "ToolParser", "get_parser", "parser_names"]


@dataclass(slots=True)
class ParsedCalls:
    content: str | None                    # the text beside the calls (None: none)
    calls: list[dict[str, Any]]            # OpenAI tool_calls entries: {id, type, function: {name, arguments}}


def _arguments(value: Any) -> str:
    """A call's arguments as OpenAI sends them: JSON text of an object (no NaN or Infinity)."""
    if isinstance(value, str):
        value = loads_strict(value)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return json_text(value)


class ToolParser:
    """One model family's tool-call format."""

    name = ""
    markers: tuple[str, ...] = ()          # text that starts a tool call
    at_start_only = False                  # a call can only open the output (after white space)

    def new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """``(name, arguments JSON)`` of each call in ``text`` (which starts at a marker), or None
        if it is not well formed."""
        raise NotImplementedError

    def start(self, text: str) -> int | None:
        """Where the first tool call starts in ``text``, or None."""
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def extract(self, text: str, names: frozenset[str] | None = None) -> ParsedCalls:
        """The content and the tool calls of a finished output. Calls are kept only when every one
        is well formed: a known function (one of ``names``, when given) with a JSON object of
        arguments; otherwise the whole text is content. The content is the text before the first
        call as written (the same text a stream sends), None when empty (or only white space, for
        formats where a call must open the output)."""
        at = self.start(text)
        if at is None:
            return ParsedCalls(text, [])
        try:
            calls = self.calls(text[at:])
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            calls = None
        if not calls or any(not name or (names is not None and name not in names) for name, _ in calls):
            return ParsedCalls(text, [])
        content = text[:at]
        if self.at_start_only and not content.strip():
            content = ""
        return ParsedCalls(content or None, [{"id": self.new_id(), "type": "function",
                                              "function": {"name": name, "arguments": args}}
                                             for name, args in calls])


def _named(obj: Any, *arg_keys: str) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call needs a name")
    key = next((k for k in arg_keys if k in obj), None)
    return obj["name"], _arguments(obj.get(key) if key else None)


_DECODER = json.JSONDecoder(parse_constant=no_json_constant)     # raw_decode, strict


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        out = []
        for m in self._CALL.finditer(text):
            body = m.group(1).strip()
            if not body:
                continue
            out.append(_named(loads_strict(body), "arguments", "parameters"))
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.strip()
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>"):]
        decoder, pos, out = _DECODER, 0, []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(text):
                return out
            obj, pos = decoder.raw_decode(text, pos)
            out.append(_named(obj, "parameters", "arguments"))


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    _ALNUM = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(random.choices(self._ALNUM, k=9))

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        out = []
        decoder = _DECODER
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if part.startswith("["):
                calls, _ = decoder.raw_decode(part)
                if not isinstance(calls, list):
                    raise ValueError("not a list of calls")
                out += [_named(c, "arguments", "parameters") for c in calls]
                continue
            # name[ARGS]{...} or name{...}
            name, sep, rest = part.partition("[ARGS]")
            if not sep:
                brace = part.find("{")
                if brace < 0:
                    raise ValueError("no arguments")
                name, rest = part[:brace], part[brace:]
            args, _ = decoder.raw_decode(rest.strip())
            out.append((name.strip(), _arguments(args)))
        return out


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "qwen2_5": HermesParser,
    "llama3_json": Llama3JsonParser, "llama": Llama3JsonParser, "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parser_names() -> list[str]:
    return sorted(PARSERS)


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(parser_names())})") from None


class AutoToolStream:
    """One streamed choice under a tool-call parser: :meth:`delta` maps each new piece of text
    to the chunk's ``delta`` (content until a call starts, the calls when the choice finishes)."""

    def __init__(self, parser: ToolParser, names: frozenset[str] | None = None) -> None:
        self.parser, self.names = parser, names
        self.seen = ""                     # all text so far
        self.sent = 0                      # chars of `seen` sent as content
        self.buffering = False             # a call started at `sent`: hold everything
        self.called = False                # tool_calls were sent

    def _split(self) -> tuple[int, bool]:
        """``(end, call)``: the unsent text up to ``end`` can go out as content now; ``call``: a
        tool call (maybe) starts at ``end``."""
        p, rest = self.parser, self.seen[self.sent:]
        if p.at_start_only:
            head = self.seen.lstrip()
            if not head:
                return self.sent, False
            if self.sent == 0 and any(m.startswith(head) or head.startswith(m) for m in p.markers):
                return 0, True             # a call (or maybe one) opens the output
            return len(self.seen), False
        at = p.start(rest)
        if at is not None:
            return self.sent + at, True
        hold = max((k for m in p.markers for k in range(1, len(m)) if rest.endswith(m[:k])), default=0)
        return len(self.seen) - hold, False

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The ``delta`` of the chunk that carries ``text`` (``final``: the choice's last)."""
        self.seen += text
        out: dict[str, Any] = {}
        content = ""
        if not self.buffering:
            end, self.buffering = self._split()
            content, self.sent = self.seen[self.sent:end], end
        if final:
            rest = self.seen[self.sent:]
            parsed = self.parser.extract(rest, self.names) if self.buffering else ParsedCalls(rest, [])
            if parsed.calls:
                content += parsed.content or ""
                out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(parsed.calls)]
                self.called = True
            else:
                content += rest
            self.sent = len(self.seen)
        if content:
            out["content"] = content
        return out
