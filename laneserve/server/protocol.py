"""OpenAI-compatible request validation:
request bodies of ``/v1/completions`` and ``/v1/chat/completions`` become one
:class:`GenerateInput`, or a :class:`BadRequest` (HTTP 400) whose message names the field and what
is wrong.

This module is the one place a request is checked before admission, in three layers:
:func:`parse_body` turns the raw bytes into JSON (bounded depth and number size, valid UTF-8 and
Unicode, no duplicate keys); the typed models of :mod:`laneserve.server.schema` check every field's
type, range, finiteness and size (a pydantic ``ValidationError`` becomes a :class:`BadRequest`
naming the field); :func:`parse_completion` / :func:`parse_chat` then check what depends on the
served model (vocabulary, context length, tokenizer, SLO classes, headers) and build the
:class:`GenerateInput`; every check that does not depend on the prompt runs before the prompt is
tokenized (or its chat template applied), so a bad field costs no tokenizer call. Whatever they
return packs for the wire and samples without error.

Accepted fields: OpenAI's, vLLM's sampling extensions (``top_k``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``priority``, ``return_token_ids`` ...)
and laneserve's SLO extensions (``slo: {ttft_ms, tpot_ms}``, ``slo_class``; headers
``x-slo-ttft-ms`` / ``x-slo-tpot-ms``). Unknown fields are accepted and ignored, as vLLM does: each
unknown name is logged once (up to ``MAX_LOGGED_UNKNOWN`` names). OpenAI and vLLM fields laneserve
does not implement are accepted only at their neutral value (``suffix``,
``spaces_between_special_tokens``) and rejected otherwise with "not supported". ``min_p``,
``allowed_token_ids`` and ``bad_words`` shape sampling as vLLM's do; ``truncate_prompt_tokens``
keeps a prompt's last k tokens, ``include_stop_str_in_output`` keeps the stop string,
``continue_final_message`` leaves the last (assistant) message open and chat ``echo`` puts it
before the reply; ``model`` is optional (the first served name).

Tool calling: ``tools`` go to the chat template, an assistant message may carry ``tool_calls``
with ``content: null`` and a ``tool`` message its ``tool_call_id`` (kept, with ``name``, in the
messages the template sees; a call's JSON ``arguments`` become an object, as templates expect).
``tool_choice`` naming a function or ``"required"`` is structured output (below); ``"auto"`` (or
absent, with tools) needs the server's tool-call parser (``--enable-auto-tool-choice
--tool-call-parser``, :mod:`laneserve.server.tool_parsers`) and is a 400 without it, as in vLLM.

Several choices: ``n`` samples of each prompt; on completions ``best_of`` >= n
samples of which the n with the highest cumulative logprob are returned (as vLLM; not with
``stream``), and a batch of prompts (a list of strings or of token-id lists, at most
``MAX_BATCH_PROMPTS``): choice ``i * n + j`` is sample j of prompt i. ``echo`` puts the prompt
before each completion; with ``logprobs`` its logprobs cover the prompt's tokens too (the first
has none), and vLLM's ``prompt_logprobs`` (top-n) returns them per prompt token (completions: in
each choice; chat: once beside the choices, the rendered template's tokens, not streamed); either way the
prefill computes the whole prompt (no prefix-cache hit) and keeps each position's logprobs.

Structured output (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, ``tools``
with ``tool_choice``) becomes ``SamplingParams.structured``; the constraint is checked here, over
the served tokenizer and within the structured-output budget (``engine/structured/grammar.py``:
milliseconds, in the parse pool, off the event loop), so a spec that cannot be enforced (a schema
keyword the grammar engine does not implement, a regex with look-around, a bad grammar, a
constraint over budget) is a 400 naming the field and the reason, never an instance error.

SLO precedence: ``slo`` field > headers > the ``slo_class``'s launch default > the server default.
A class not configured at launch is accepted as a label only when the request sets both targets
itself (load generators replaying a workload's classes); otherwise it is a 400.
``priority`` follows vLLM (lower = served earlier by priority-aware policies).

``max_tokens`` defaults: 16 for completions (OpenAI's and vLLM's default); for chat the remaining
context, capped at the server's ``default_max_tokens`` (a cap vLLM does not apply: random-weight
smoke models rarely sample EOS). ``min_tokens`` may not exceed it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from laneserve.core.sampling import GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN, SamplingParams
from laneserve.core.slo import SLO, SLOClass
from laneserve.core.structured import StructuredSpec, UnsupportedSpec
from laneserve.server.schema import (MAX_BATCH_PROMPTS, MAX_CHARS_PER_TOKEN, MAX_JSON_DEPTH, MAX_LABEL_CHARS, MAX_MESSAGES,
                                     MAX_NAME_CHARS, MAX_SLO_MS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                     ChatCompletionRequest, CompletionRequest, SLOTargets)
from laneserve.server.structured import spec_from_request
from laneserve.server.templates import DEFAULT_RENDER_TIMEOUT, TemplateOverrun, render_deadline

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "MAX_BATCH_PROMPTS", "MAX_JSON_DEPTH", "MAX_MESSAGES", "MAX_STOP_STRINGS",
           "MAX_STOP_TOKEN_IDS", "BadRequest", "GenerateInput", "PromptInput", "ServerDefaults", "parse_body", "parse_chat",
           "parse_completion"]

# the top-level fields each endpoint reads; any other is ignored (and logged once per name)
COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields)
CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)

log = logging.getLogger("laneserve.server")
# the fields that may ask for structured output (laneserve.server.structured reads them)
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")
_M = TypeVar("_M", bound=BaseModel)
MAX_LOGGED_UNKNOWN = 256       # unknown field names remembered (each logged once); later ones are not logged
MAX_SEQUENCES = 256            # prompts x best_of (the sequences one request generates)

_LABEL = re.compile(r"[A-Za-z0-9_.:-]+")
# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
_TEMPLATE_RESERVED = {"conversation", "messages", "chat_template", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- the body ------------------------------------------------------------------------------------
# The depth scan, one left-to-right pass with no recursion: each match skips strings (so brackets in
# them do not count) and everything else up to the next bracket, or stops at a quote that starts no
# complete string (malformed JSON). Linear: possessive repeats never backtrack.
_DEPTH_SCAN = re.compile(r'(?:"[^"\\]*+(?:\\.[^"\\]*+)*+"|[^"\[\]{}]++)*+'
                         r'(?:(?P<open>[\[{])|(?P<close>[\]}])|(?P<unterminated>"))', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of a request body, or :class:`BadRequest` for: invalid UTF-8, malformed JSON,
    nesting deeper than ``max_depth``, a number out of range (a float literal beyond the double
    range such as ``1e999``; an integer literal longer than Python's int-digit limit, 4300 digits by
    default — shorter ints are bounded by each field's check), a duplicated object key, or a lone
    surrogate (``"\\ud800"``) in any string or key. Depth is checked by a scan of the text before
    ``json.loads`` (only when the body has more opening brackets than ``max_depth``), so a hostile
    body cannot make anything recurse. ``NaN``/``Infinity`` literals parse to floats (Python's
    ``json`` behaviour) so that the field checks reject them naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"malformed JSON in the request body: not valid UTF-8 (byte {exc.start})") from None
    if text.count("[") + text.count("{") > max_depth:
        depth = 0
        for m in _DEPTH_SCAN.finditer(text):
            kind = m.lastgroup
            if kind == "open":
                depth += 1
                if depth > max_depth:
                    raise BadRequest(f"the request body nests deeper than {max_depth} levels")
            elif kind == "close":
                depth -= 1
            else:
                raise BadRequest(f"malformed JSON in the request body: unterminated string at char {m.end() - 1}")
    try:
        body = json.loads(text, parse_float=_parse_float, object_pairs_hook=_json_object)
    except BadRequest:
        raise
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}") from None
    except RecursionError:                      # only with a max_depth beyond the interpreter's limit
        raise BadRequest("the request body nests too deeply") from None
    except ValueError:                          # an int longer than Python's int-digit limit
        raise BadRequest("the request body holds a number too large to parse") from None
    if "\\u" in text:              # only a \u escape can produce a lone surrogate from valid UTF-8
        _reject_surrogates(body)
    return body


def _parse_float(literal: str) -> float:
    v = float(literal)
    if math.isinf(v):
        raise BadRequest(f"the number {_show(literal)} in the request body is out of range")
    return v


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise BadRequest(f"duplicate key {_show(dup)} in the request body", dup if len(dup) <= 64 else None)
    return obj


def _reject_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            strings: Any = (v,)
        elif isinstance(v, dict):
            strings = v.keys()
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
            continue
        else:
            continue
        for s in strings:
            if not s.isascii() and _SURROGATE.search(s):
                raise BadRequest("the request body holds a string that is not valid Unicode text "
                                 "(a lone surrogate \\ud800-\\udfff)")


def _show(v: Any, limit: int = 40) -> str:
    """A short repr of client input for error messages (no unbounded echo, no huge int to text)."""
    if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
        return "an integer outside int64"
    if isinstance(v, (list, dict)):
        return type(v).__name__
    s = repr(v[:limit + 1] if isinstance(v, str) else v)
    return s if len(s) <= limit else s[:limit] + "..."


@dataclass(slots=True)
class ServerDefaults:
    default_slo: SLO = SLO()
    classes: dict[str, SLOClass] = field(default_factory=dict)
    default_max_tokens: int = 256
    tool_parser: str | None = None         # --enable-auto-tool-choice --tool-call-parser NAME, else None
    chat_template: str | None = None       # --chat-template: replaces the tokenizer's
    served_names: tuple[str, ...] = ()     # --served-model-name(s): the first answers, and is a request's default
    max_model_len: int | None = None       # --max-model-len: caps the model's context
    open_json_objects: bool = False        # --json-schema-open-objects: no additionalProperties = any key
    render_timeout: float = DEFAULT_RENDER_TIMEOUT   # seconds one chat-template render may take


@dataclass(slots=True)
class PromptInput:
    ids: list[int]
    text: str | None = None                # the prompt as sent (None: sent as token ids)


@dataclass(slots=True)
class GenerateInput:
    kind: str                              # "completion" | "chat"
    model: str
    prompts: list[PromptInput]             # one, or a batch (completions)
    sampling: SamplingParams               # sampling.n = best_of samples of each prompt
    slo: SLO
    slo_class: str
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    logprobs: int | None                   # top-n per token, or None
    skip_special_tokens: bool = True
    n: int = 1                             # choices returned per prompt (the best n of sampling.n)
    echo: bool = False
    prompt_logprobs: int | None = None     # vLLM's prompt_logprobs field asked (top-n), else None
    tool_parser: str | None = None         # chat: parse the output's tool calls with this parser
    tool_names: frozenset[str] | None = None   # chat: the functions in `tools` (a parsed call must name one)
    include_stop_str: bool = False         # keep a matched stop string in the output
    chat_echo: str = ""                    # chat echo: this text starts each reply
    echo_only: bool = False                # completions echo with max_tokens 0: the output is dropped

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's token ids."""
        return self.prompts[0].ids


# ---- the models' errors as 400s --------------------------------------------------------------------
# what a field holds, for type errors (a union's members each report an error: one message instead)
_EXPECTS = {
    "prompt": "a string or a list of token ids, or a batch: a list of strings or token-id lists",
    "stop": f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings (each at most "
            f"{MAX_STOP_CHARS} characters)",
    "messages": "a non-empty list of {role, content} objects",
    "content": "a string or a list of text parts",
    "stop_token_ids": "a list of integers (token ids)",
    "logit_bias": "an object of token id (a decimal string) -> number",
    "tool_choice": "a string or an object",
    "guided_json": "a JSON schema (an object, or its JSON text)",
    "slo": 'an object like {"ttft_ms": 500, "tpot_ms": 50}',
    "stream_options": "an object with 'include_usage' and/or 'continuous_usage_stats'",
    "chat_template_kwargs values": f"null, a boolean, a finite number or a string of at most {MAX_NAME_CHARS} "
                                   "characters",
}
_TYPE_NAMES = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
               "string_type": "a string", "list_type": "a list", "dict_type": "an object",
               "model_type": "an object", "model_attributes_type": "an object"}
_UNION_TAG = re.compile(r"[\[\]\-]|^(str|int|float|bool|list|dict|none|function)$")


def _field_path(loc: tuple) -> str:
    """``('messages', 0, 'role')`` -> ``messages[0].role``; union-member tags are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " key"
        elif not _UNION_TAG.search(part):
            part = part if len(part) <= 64 else part[:64] + "..."      # a client's key: no unbounded echo
            out += f".{part}" if out else part
    return out


def _bound(model: type[BaseModel], name: str) -> str | None:
    """The range of a numeric field with two bounds (not int64's), as ``[lo, hi]`` or ``(lo, hi]``."""
    info = model.model_fields.get(name)
    if info is None:
        return None
    lo = hi = None
    lo_open = False
    for arg in getattr(info.annotation, "__args__", ()) or ():
        for meta in getattr(arg, "__metadata__", ()):
            for c in getattr(meta, "metadata", ()):
                lo = getattr(c, "ge", lo)
                if getattr(c, "gt", None) is not None:
                    lo, lo_open = c.gt, True
                hi = getattr(c, "le", hi)
    if lo is None or hi is None or isinstance(hi, int) and not isinstance(hi, bool) and abs(hi) >= INT64_MAX:
        return None
    if isinstance(lo, float) or isinstance(hi, float):
        lo, hi = float(lo), float(hi)
    return f"{'(' if lo_open else '['}{lo}, {hi}]"


def _bad_request(exc: ValidationError, model: type[BaseModel]) -> BadRequest:
    """The first error of ``exc`` as a :class:`BadRequest` naming the field (``param`` = the
    top-level field)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc, kind, ctx, value = err["loc"], err["type"], err.get("ctx") or {}, err.get("input")
    param = loc[0] if loc and isinstance(loc[0], str) else None
    path = _field_path(loc) or "the request body"
    leaf = next((x for x in reversed(loc) if isinstance(x, str) and not _UNION_TAG.search(x)), None)
    union = len(errors) > 1 and len({e["loc"][:1] for e in errors}) == 1 and any(
        isinstance(x, str) and _UNION_TAG.search(x) for x in loc)
    if kind == "missing":
        msg = f"missing required field '{path}'"
    elif param == "slo" and len(loc) > 1 and kind != "extra_forbidden":
        msg = f"'{path}' must be a number > 0 and <= {MAX_SLO_MS} (milliseconds), got {_show(value)}"
    elif union or (kind in _TYPE_NAMES and leaf == path and leaf in _EXPECTS):
        expects = _EXPECTS.get(leaf) or _EXPECTS.get(f"{param} values", "of another type")
        msg = f"'{path}' must be {expects}, got {_type_name(value)}"
    elif kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):   # too large a float
        msg = f"'{path}' must be in {_bound(model, path) or 'the double range'}, got {_show(value)}"
    elif kind in _TYPE_NAMES:
        msg = f"'{path}' must be {_TYPE_NAMES[kind]}, got {_type_name(value)}"
    elif kind == "finite_number":
        msg = f"'{path}' must be a finite number, got {value}"
    elif kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        rng = _bound(model, path) if path == param else None
        if rng is not None:
            msg = f"'{path}' must be in {rng}, got {_show(value)}"
        else:
            op, bound = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"),
                         "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}[kind]
            msg = f"'{path}' must be {op} {ctx[bound]}, got {_show(value)}"
    elif kind in ("too_long", "string_too_long"):
        what = "characters" if kind == "string_too_long" else "entries"
        msg = f"'{path}' may hold at most {ctx['max_length']} {what}"
        if kind == "string_too_long":
            msg = f"'{path}' is longer than {ctx['max_length']} characters"
    elif kind in ("too_short", "string_too_short"):
        msg = f"'{path}' must not be empty"
    elif kind == "literal_error":
        msg = f"'{path}' must be {ctx.get('expected')}, got {_show(value)}"
    elif kind == "string_pattern_mismatch" and param == "logit_bias":
        msg = f"'logit_bias' keys must be token ids (decimal strings), got {_show(value)}"
    elif kind == "extra_forbidden":
        msg = f"unknown field '{path}'"
    else:
        msg = f"'{path}': {err['msg']}"
    if path.startswith("messages["):          # as before: messages[0].role must be one of ...
        msg = msg.replace(f"'{path}'", path, 1)
    return BadRequest(msg, param if param is None or len(param) <= 64 else None)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


_logged_unknown: set[str] = set()


def _log_unknown(body: dict, model: type[BaseModel]) -> None:
    """Log each unknown top-level field name once (vLLM's warning), remembering a bounded set."""
    if len(_logged_unknown) >= MAX_LOGGED_UNKNOWN:
        return
    known = model.model_fields
    for name in body:
        if name not in known and name not in _logged_unknown and len(_logged_unknown) < MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(name)
            log.warning("ignoring unknown request field %s (logged once per name)", _show(name, 64))


def _validate(body: Any, model: type[_M]) -> _M:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not all(isinstance(k, str) for k in body):       # only a body built in-process, not JSON
        raise BadRequest("field names must be strings")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _bad_request(exc, model) from None
    if len(body) > len(req.model_fields_set):
        _log_unknown(body, model)
    return req


# ---- checks that depend on the served model ------------------------------------------------------
def _neutral(value: Any, neutral: Any, name: str, what: str) -> None:
    if value is not None and value != neutral:
        raise BadRequest(f"'{name}' is not supported by laneserve ({what})", name)


def _in_vocab(ids: list[int], vocab_size: int, what: str, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{what} {_show(bad)} is outside the vocabulary [0, {vocab_size})", param)


SLO_HEADERS = (("x-slo-ttft-ms", "ttft_ms"), ("x-slo-tpot-ms", "tpot_ms"))


def _header_targets(headers: dict[str, str]) -> SLOTargets:
    """The ``x-slo-*-ms`` headers read through the body's own model (:class:`SLOTargets`, its
    numbers from text): one check, one bound, one message for both ways of giving a target."""
    given = {key: headers[h] for h, key in SLO_HEADERS if headers.get(h) is not None}
    try:
        return SLOTargets.model_validate(given, strict=False)
    except ValidationError as exc:
        key = exc.errors(include_url=False)[0]["loc"][0]
        header = next(h for h, k in SLO_HEADERS if k == key)
        raise BadRequest(f"header {header} must be a number > 0 and <= {MAX_SLO_MS} (milliseconds), "
                         f"got {_show(given[key])}", header) from None


def _slo(req, headers: dict[str, str], defaults: ServerDefaults) -> tuple[SLO, str, int]:
    cls_name = req.slo_class
    base, priority = defaults.default_slo, 0
    unknown_class = False
    if cls_name is not None and cls_name != "default":
        cls = defaults.classes.get(cls_name)
        if cls is None:
            unknown_class = True
        else:
            base, priority = cls.slo.with_defaults(base), cls.priority
    ttft, tpot = base.ttft, base.tpot
    own = set()
    for targets in (_header_targets(headers), req.slo):     # the body's slo over the headers
        if targets is None:
            continue
        if targets.ttft_ms is not None:
            ttft, _ = targets.ttft_ms / 1e3, own.add("ttft_ms")
        if targets.tpot_ms is not None:
            tpot, _ = targets.tpot_ms / 1e3, own.add("tpot_ms")
    if unknown_class:
        if own != {"ttft_ms", "tpot_ms"}:
            # an unknown class is only a label; it cannot supply defaults
            known = ", ".join(["default", *sorted(defaults.classes)])
            raise BadRequest(f"unknown slo_class {_show(cls_name)} (known: {known}); a request may name another "
                             "class only when it sets both SLO targets itself", "slo_class")
        if len(cls_name) > MAX_LABEL_CHARS or not _LABEL.fullmatch(cls_name):
            raise BadRequest(f"an slo_class label must be 1-{MAX_LABEL_CHARS} characters of A-Z a-z 0-9 _ . : -",
                             "slo_class")
    return SLO(ttft, tpot), cls_name or "default", priority if req.priority is None else req.priority


def text_limit(text_chars: int, max_model_len: int, param: str) -> None:
    """A prompt of ``text_chars`` characters refused (400) when it cannot fit the context, before
    it is tokenized."""
    _text_limit(text_chars, max_model_len, param)


def _text_limit(text_chars: int, max_model_len: int, param: str) -> None:
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if text_chars > limit:
        raise BadRequest(f"the prompt has {text_chars} characters, more than can fit this model's context "
                         f"of {max_model_len} tokens ({limit} characters)", param)


@dataclass(slots=True)
class _Checked:
    """What the prompt-independent fields say, checked before the prompt is tokenized (a bad field
    costs no tokenizer call)."""

    sampling: dict[str, Any]               # SamplingParams keywords, all but max_tokens
    slo: SLO
    slo_class: str
    priority: int
    logprobs: int | None                   # what the client asked for (best_of may sample more)


def _min_tokens_fit(min_tokens: int, max_tokens: int, max_tokens_key: str) -> None:
    if min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({min_tokens}) must be <= {max_tokens_key} ({max_tokens})", "min_tokens")


def _structured(body: dict, req: CompletionRequest | ChatCompletionRequest, tokenizer,
                defaults: ServerDefaults) -> StructuredSpec | None:
    """The request's structured-output constraint, compiled once over ``tokenizer`` to check it."""
    fields = {k: body[k] for k in STRUCTURED_FIELDS if k in body and k in type(req).model_fields}
    given = [k for k, v in fields.items() if v is not None]
    try:
        spec = spec_from_request(fields, open_objects=defaults.open_json_objects)
    except UnsupportedSpec as exc:
        field_name = _named(str(exc), given)
        msg = str(exc) if field_name is None or field_name in str(exc) else f"'{field_name}': {exc}"
        raise BadRequest(msg, field_name) from None
    if spec is None:
        return None
    param = next((k for k in given if k not in ("tools", "parallel_tool_calls")), given[0])
    if tokenizer is None:
        raise BadRequest("structured output needs a tokenizer; this model has none", param)
    from laneserve.engine.structured import compile_constraint     # torch: only when a request asks

    try:
        compile_constraint(spec, tokenizer)
    except UnsupportedSpec as exc:
        raise BadRequest(f"'{param}': {exc}", param) from None
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as exc:  # noqa: BLE001 - the grammar engine may panic (a BaseException) on odd input
        raise BadRequest(f"the structured-output constraint cannot be compiled: {_show(str(exc), 200)}",
                         param) from None
    return spec


def _consistent(sampling: dict[str, Any], structured: StructuredSpec | None, tokenizer) -> None:
    """Sampling constraints that cannot all hold, refused (400 naming the field) rather than
    failing on the instance with no token left to sample: ``allowed_token_ids`` holding only tokens
    that ``min_tokens`` bans (EOS, ``stop_token_ids``), and ``allowed_token_ids`` or ``bad_words``
    leaving none of the tokens a structured-output constraint allows first."""
    allowed, min_tokens = set(sampling["allowed_token_ids"]), sampling["min_tokens"]
    eos = getattr(tokenizer, "eos_token_id", None)
    if allowed and min_tokens:
        keep_eos = sampling["ignore_eos"] or structured is not None
        banned = set(sampling["stop_token_ids"]) | (set() if keep_eos or eos is None else {eos})
        if allowed <= banned:
            raise BadRequest(f"'allowed_token_ids' holds only end-of-sequence or stop tokens, which 'min_tokens' "
                             f"({min_tokens}) forbids for the first tokens: nothing could be sampled",
                             "allowed_token_ids")
    banned_words = {w[0] for w in sampling["bad_words_ids"] if len(w) == 1}
    if structured is None or not (allowed or banned_words):
        return
    from laneserve.engine.structured import compile_constraint     # compiled (and cached) already

    first = compile_constraint(structured, tokenizer).first_tokens()
    if allowed and not first & allowed:
        raise BadRequest("'allowed_token_ids' allows none of the tokens the structured-output constraint allows "
                         "first: nothing could be sampled", "allowed_token_ids")
    if banned_words and first and first <= banned_words:
        raise BadRequest("'bad_words' bans every token the structured-output constraint allows first: nothing "
                         "could be sampled", "bad_words")


def _bad_words(words: list[str] | None, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences: each word as written (leading spaces dropped), and
    with one leading space where that spells it with as many tokens but a different first one."""
    if not words:
        return ()
    if tokenizer is None:
        raise BadRequest("'bad_words' needs a tokenizer; this model has none (use logit_bias)", "bad_words")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for seq in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
            if seq:
                _in_vocab(list(seq), vocab_size, "bad_words token id", "bad_words")
                out.append(seq)
    return tuple(dict.fromkeys(out))


def _named(message: str, given: list[str]) -> str | None:
    """The field an UnsupportedSpec message is about (it names the field it was raised for)."""
    return next((k for k in sorted(given, key=len, reverse=True) if k in message), given[0] if given else None)


def _check_common(req: CompletionRequest | ChatCompletionRequest, vocab_size: int, headers: dict[str, str],
                  defaults: ServerDefaults, has_tokenizer: bool, logprobs: int | None, max_tokens: int | None,
                  max_tokens_key: str, structured: StructuredSpec | None = None, samples: int = 1) -> _Checked:
    """The checks of the fields shared by both endpoints that do not depend on the prompt;
    ``max_tokens`` is None when its default depends on the prompt (chat)."""
    _neutral(req.spaces_between_special_tokens, True, "spaces_between_special_tokens", "only true")
    allowed = tuple(sorted(set(req.allowed_token_ids or ())))
    _in_vocab(list(allowed), vocab_size, "allowed token id", "allowed_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if stop and not has_tokenizer:
        raise BadRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    stop_ids = tuple(req.stop_token_ids or ())
    _in_vocab(list(stop_ids), vocab_size, "stop token id", "stop_token_ids")
    bias = tuple((int(k), v) for k, v in (req.logit_bias or {}).items())
    _in_vocab([t for t, _ in bias], vocab_size, "logit_bias token id", "logit_bias")
    if len({t for t, _ in bias}) != len(bias):         # "01" and "1"
        raise BadRequest("'logit_bias' names a token id twice", "logit_bias")
    min_tokens = req.min_tokens or 0
    if max_tokens is not None:
        _min_tokens_fit(min_tokens, max_tokens, max_tokens_key)
    top_k = -1 if req.top_k is None or req.top_k == 0 or req.top_k >= vocab_size else req.top_k
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if temperature < GREEDY_TEMPERATURE:       # as vLLM: a sub-1e-5 temperature is greedy
        temperature = 0.0
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:   # {}: as vLLM
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    sampling = dict(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
                    seed=req.seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos),
                    # best_of > n ranks the samples by cumulative logprob: each token's is needed
                    logprobs=0 if logprobs is None and samples > (req.n or 1) else logprobs, presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logit_bias=bias, min_tokens=min_tokens, structured=structured, n=samples,
                    min_p=req.min_p or 0.0, allowed_token_ids=allowed)
    slo, slo_class, priority = _slo(req, headers, defaults)
    return _Checked(sampling, slo, slo_class, priority, logprobs)


def _finish(req: CompletionRequest | ChatCompletionRequest, kind: str, c: _Checked, prompts: list[PromptInput],
            max_model_len: int, vocab_size: int, kv_tokens: int, defaults: ServerDefaults, max_tokens: int | None,
            max_tokens_key: str, n: int = 1, echo: bool = False) -> GenerateInput:
    """The prompt-dependent checks (vocabulary, context, KV) and the :class:`GenerateInput`."""
    k = req.truncate_prompt_tokens
    if k is not None:                          # keep the last k tokens, as vLLM (-1: the context length)
        k = max_model_len if k == -1 else k
        if k < 1:
            raise BadRequest("'truncate_prompt_tokens' must be -1 or >= 1", "truncate_prompt_tokens")
        for p in prompts:
            if len(p.ids) > k:
                p.ids, p.text = p.ids[-k:], None
    for p in prompts:
        if not p.ids:
            raise BadRequest("the prompt is empty", "prompt" if kind == "completion" else "messages")
        _in_vocab(p.ids, vocab_size, "token id", "prompt")
    n_prompt = max(len(p.ids) for p in prompts)       # the longest must fit
    room = max_model_len - n_prompt
    if room < 1:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt has {n_prompt} tokens, leaving no room for output.", "prompt")
    if max_tokens is None:                     # chat's default: the context left, capped
        max_tokens = min(room, defaults.default_max_tokens)
        _min_tokens_fit(c.sampling["min_tokens"], max_tokens, max_tokens_key)
    if n_prompt + max_tokens > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} "
                         "for the completion). Please reduce the length of the prompt or max_tokens.",
                         max_tokens_key)
    if n_prompt + max_tokens > kv_tokens:
        raise BadRequest(f"prompt + max_tokens ({n_prompt + max_tokens} tokens) does not fit the KV cache "
                         f"of an instance ({kv_tokens} tokens)", max_tokens_key)
    try:
        sampling = SamplingParams(max_tokens=max_tokens, **c.sampling)
    except ValueError as exc:       # the checks above should leave nothing for SamplingParams to refuse
        raise BadRequest(str(exc)) from None
    so = req.stream_options
    return GenerateInput(kind, _model(req.model, defaults), prompts, sampling, c.slo, c.slo_class, c.priority,
                         bool(req.stream),
                         bool(so and so.include_usage), bool(so and so.continuous_usage_stats),
                         bool(req.return_token_ids), c.logprobs,
                         True if req.skip_special_tokens is None else req.skip_special_tokens, n, echo)


def _model(name: str | None, defaults: ServerDefaults) -> str:
    """The served model a request names: optional (the first served name), any served name maps
    to the first."""
    if name is None or name in defaults.served_names[1:]:
        return defaults.served_names[0] if defaults.served_names else (name or "")
    return name


def parse_completion(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
                     headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    req = _validate(body, CompletionRequest)
    max_model_len = min(max_model_len, defaults.max_model_len or max_model_len)
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for p in batch:
        if isinstance(p, str):
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            _text_limit(len(p), max_model_len, "prompt")
    n = req.n or 1
    best_of = n if req.best_of is None else req.best_of
    if best_of < n:
        raise BadRequest(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    if best_of > n and req.stream:
        raise BadRequest("'best_of' > 'n' is not supported with 'stream': true", "best_of")
    if len(batch) * best_of > MAX_SEQUENCES:
        raise BadRequest(f"{len(batch)} prompt(s) x {best_of} samples is more than {MAX_SEQUENCES} sequences "
                         "in one request", "best_of" if best_of > 1 else "n")
    _neutral(req.suffix, None, "suffix", "no suffix")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens      # OpenAI's and vLLM's default
    echo_only = max_tokens == 0                 # vLLM: echo with max_tokens 0 returns the prompt alone
    if echo_only and not req.echo:
        raise BadRequest("'max_tokens' must be >= 1 (0 only with 'echo': true), got 0", "max_tokens")
    max_tokens = max_tokens or 1                # one token is generated and dropped
    structured = _structured(body, req, tokenizer, defaults)
    checked = _check_common(req, vocab_size, headers, defaults, tokenizer is not None, req.logprobs, max_tokens,
                            "max_tokens", structured, best_of)
    checked.sampling["bad_words_ids"] = _bad_words(req.bad_words, tokenizer, vocab_size)
    _consistent(checked.sampling, structured, tokenizer)
    echo = bool(req.echo)
    # prompt logprobs: echo with logprobs (OpenAI) and vLLM's prompt_logprobs; the prefill then
    # computes every prompt position (no prefix-cache hit) and keeps their logprobs
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if echo else None) if k is not None]
    if wanted:
        checked.sampling["prompt_logprobs"] = max(wanted)
    prompts = [PromptInput(list(tokenizer.encode(p)), p) if isinstance(p, str) else PromptInput(list(p))
               for p in batch]
    gi = _finish(req, "completion", checked, prompts, max_model_len, vocab_size, kv_tokens, defaults, max_tokens,
                 "max_tokens", n, echo)
    gi.prompt_logprobs = req.prompt_logprobs
    gi.include_stop_str = bool(req.include_stop_str_in_output)
    gi.echo_only = echo_only
    return gi


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    for k in kwargs or ():
        if k in _TEMPLATE_RESERVED or not k.isidentifier():
            raise BadRequest(f"'chat_template_kwargs' may not set {_show(k)}", "chat_template_kwargs")
    return kwargs or {}


def parse_chat(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
               headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    req = _validate(body, ChatCompletionRequest)
    max_model_len = min(max_model_len, defaults.max_model_len or max_model_len)
    if tokenizer is None or not (defaults.chat_template or getattr(tokenizer, "chat_template", None)):
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    msgs = _messages(req)
    _rendered_limit(req, msgs, max_model_len)
    tools = req.tools or None
    tool_names = _tool_names(tools)
    tool_parser = _auto_tools(req, tools, defaults)
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _template_kwargs(req.chat_template_kwargs)
    max_tokens, key = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None and req.max_tokens is not None:
        max_tokens, key = req.max_tokens, "max_tokens"
    if max_tokens == 0:
        raise BadRequest(f"'{key}' must be >= 1, got 0", key)
    structured = _structured(body, req, tokenizer, defaults)
    n = req.n or 1
    checked = _check_common(req, vocab_size, headers, defaults, True, logprobs, max_tokens, key, structured, n)
    checked.sampling["bad_words_ids"] = _bad_words(req.bad_words, tokenizer, vocab_size)
    _consistent(checked.sampling, structured, tokenizer)
    if req.prompt_logprobs is not None:
        if req.stream:
            raise BadRequest("'prompt_logprobs' is not supported with 'stream': true on chat completions",
                             "prompt_logprobs")
        checked.sampling["prompt_logprobs"] = req.prompt_logprobs
    text = _render(req, msgs, kwargs, tokenizer, defaults, max_model_len * MAX_CHARS_PER_TOKEN)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    gi = _finish(req, "chat", checked, [PromptInput(ids, text)], max_model_len, vocab_size, kv_tokens, defaults,
                 max_tokens, key, n)
    gi.prompt_logprobs = req.prompt_logprobs
    gi.tool_parser = tool_parser
    gi.tool_names = tool_names
    gi.include_stop_str = bool(req.include_stop_str_in_output)
    if req.echo and msgs[-1]["role"] == "assistant":     # vLLM: only a last message of the reply's role
        gi.chat_echo = msgs[-1]["content"]
    return gi


def _render(req: ChatCompletionRequest, msgs: list[dict[str, Any]], kwargs: dict[str, Any], tokenizer,
            defaults: ServerDefaults, max_chars: int | None = None) -> str:
    """The chat template applied: the request's tools, the served template (``--chat-template``),
    ``add_generation_prompt`` and ``continue_final_message`` (the reply continues the last
    message: no generation prompt, the message left open)."""
    kwargs = dict(kwargs)
    if req.tools:
        kwargs["tools"] = req.tools
    if defaults.chat_template:
        kwargs["chat_template"] = defaults.chat_template
    add_prompt = req.add_generation_prompt is not False
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise BadRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                             "continue_final_message")
        if msgs[-1]["role"] != "assistant":
            raise BadRequest("'continue_final_message' needs an assistant message last", "continue_final_message")
        add_prompt, kwargs["continue_final_message"] = False, True
    try:
        with render_deadline(defaults.render_timeout):
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_prompt, **kwargs)
    except TemplateOverrun as exc:
        raise BadRequest(f"{exc} on these messages (a render is bounded; see --chat-template)", "messages") from None
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise BadRequest(f"the chat template failed on these messages: {_show(str(exc), 200)}", "messages") from None
    if not isinstance(text, str):
        raise BadRequest("the chat template did not produce text", "messages")
    if max_chars is not None and len(text) > max_chars:
        raise BadRequest(f"the chat template rendered {len(text)} characters, more than can fit this model's "
                         f"context ({max_chars} characters)", "messages")
    return text


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (vLLM's shape): text content (null -> ""),
    and an assistant's ``tool_calls`` (arguments as an object, as templates expect), a tool
    message's ``tool_call_id`` and a ``name`` kept."""
    out = []
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts (null only in an "
                             "assistant message with tool_calls)", "messages")
        if m.tool_calls and m.role != "assistant":
            raise BadRequest(f"messages[{i}].tool_calls is only allowed in an assistant message", "messages")
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or ())
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                         "messages") from None
                call: dict[str, Any] = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
                if c.id is not None:
                    call["id"] = c.id
                calls.append(call)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _rendered_limit(req: ChatCompletionRequest, msgs: list[dict[str, Any]], max_model_len: int) -> None:
    """What the chat template will render (the messages, their tool calls and the tools) held to
    the prompt's character budget before the template or the tokenizer runs."""
    chars = sum(len(m["content"]) + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
                for m in msgs)
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if req.tools and chars <= limit:
        chars += sum(len(json.dumps(t, separators=(",", ":"))) for t in req.tools)
        if chars > limit:
            raise BadRequest(f"the messages and tools have {chars} characters, more than can fit this model's "
                             f"context of {max_model_len} tokens ({limit} characters)", "tools")
    _text_limit(chars, max_model_len, "messages")


def _tool_names(tools: list[dict[str, Any]] | None) -> frozenset[str] | None:
    """The function names of ``tools`` (each once: a name given twice is a 400, as one of the two
    would silently win)."""
    if not tools:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}} "
                             "with a non-empty name", "tools")
        if name in names:
            raise BadRequest(f"tools[{i}]: the function name {_show(name)} is given twice", "tools")
        names.add(name)
    return frozenset(names)


def _auto_tools(req: ChatCompletionRequest, tools: list | None, defaults: ServerDefaults) -> str | None:
    """The tool-call parser that reads this request's output (``tools`` with ``tool_choice``
    "auto" or absent, on a server started with auto tool choice), else None. As vLLM, "auto"
    without it is refused rather than answered with unparsed text."""
    if not tools or req.tool_choice not in (None, "auto"):
        return None
    if defaults.tool_parser is None:
        raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                         "on the server (or send tool_choice \"required\", \"none\" or a named function)",
                         "tool_choice")
    return defaults.tool_parser


def chat_prompt(body: Any, *, tokenizer, defaults: ServerDefaults, max_model_len: int) -> str:
    """The text the chat template makes of a body's ``messages`` (with its ``tools``,
    ``add_generation_prompt``, ``chat_template_kwargs``): what ``/tokenize`` counts. The messages
    and tools are held to a chat request's character budget first."""
    req = _validate(body, ChatCompletionRequest)
    if tokenizer is None or not (defaults.chat_template or getattr(tokenizer, "chat_template", None)):
        raise BadRequest("this model has no chat template", "messages")
    msgs = _messages(req)
    _rendered_limit(req, msgs, max_model_len)
    _tool_names(req.tools or None)
    return _render(req, msgs, _template_kwargs(req.chat_template_kwargs), tokenizer, defaults,
                   max_model_len * MAX_CHARS_PER_TOKEN)
