"""OpenAI-compatible request validation (issue 6, items 2-4; issue 11, item 1): request bodies of
``/v1/completions`` and ``/v1/chat/completions`` become one :class:`GenerateInput`, or a
:class:`BadRequest` (HTTP 400) whose message names the field and what is wrong.

This module is the one place a request is checked before admission: :func:`parse_body` turns the
raw bytes into JSON (bounded depth and number size, valid UTF-8 and Unicode), then
:func:`parse_completion` / :func:`parse_chat` check every field's type, range and finiteness
against the limits below. Whatever they return packs for the wire and samples without error.

Accepted fields: OpenAI's, vLLM's sampling extensions (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ``return_token_ids``) and laneserve's SLO extensions (``slo:
{ttft_ms, tpot_ms}``, ``slo_class``; headers ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``). Unknown fields
are rejected (a typo must not silently change behaviour). OpenAI fields laneserve does not
implement are accepted only at their neutral value (``n=1``, ``presence_penalty=0`` ...) and
rejected otherwise with "not supported".

SLO precedence: ``slo`` field > headers > the ``slo_class``'s launch default > the server default.
A class not configured at launch is accepted as a label only when the request sets both targets
itself (load generators replaying a workload's classes); otherwise it is a 400.
``priority`` follows vLLM (lower = served earlier by priority-aware policies).

``max_tokens`` defaults: 16 for completions (OpenAI's and vLLM's default); for chat the remaining
context, capped at the server's ``default_max_tokens`` (a cap vLLM does not apply: random-weight
smoke models rarely sample EOS).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from laneserve.core.sampling import (GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams,
                                     is_int, is_real)
from laneserve.core.slo import SLO, SLOClass

# ---- limits (issue 11) ---------------------------------------------------------------------------
# Each is far beyond what a legitimate client sends, and small enough that no single request can
# make the server recurse, allocate, compute or echo without bound. Every accepted int fits the
# wire (msgpack int64): seeds and priorities are int64 like vLLM's seed (torch.long's range).
MAX_JSON_DEPTH = 32            # nested arrays/objects in a body; a chat request with text parts needs 5
MAX_TEMPERATURE = 2.0          # OpenAI's range [0, 2]; below GREEDY_TEMPERATURE (1e-5) is greedy
MAX_STOP_STRINGS = 16          # OpenAI allows 4
MAX_STOP_CHARS = 256           # per stop string (the stop checker decodes ~2x this many tokens a step)
MAX_STOP_TOKEN_IDS = 256
MAX_CHARS_PER_TOKEN = 64       # prompt text beyond max_model_len * this cannot fit the context
MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 1024       # text parts of one message
MAX_NAME_CHARS = 1024          # 'model', 'user', 'service_tier'
MAX_LABEL_CHARS = 64           # an slo_class that is only a label (it becomes a metrics label)
MAX_SLO_MS = 86_400_000        # one day, for slo.ttft_ms / slo.tpot_ms and the x-slo-*-ms headers
MAX_TEMPLATE_KWARGS = 16       # chat_template_kwargs entries, scalar values, strings <= MAX_NAME_CHARS
MAX_METADATA = 16              # OpenAI's metadata limits: 16 pairs, keys <= 64 chars, values <= 512
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512

_LABEL = re.compile(r"[A-Za-z0-9_.:-]+")
# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
_TEMPLATE_RESERVED = {"conversation", "messages", "chat_template", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "user",
           # vLLM extensions
           "top_k", "ignore_eos", "stop_token_ids", "priority", "return_token_ids", "skip_special_tokens",
           "min_tokens", "repetition_penalty", "min_p",
           # laneserve extensions
           "slo", "slo_class"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo", "best_of", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                         "chat_template_kwargs", "metadata", "store", "service_tier"}
_ROLES = ("system", "user", "assistant", "developer", "tool")


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


@dataclass(slots=True)
class GenerateInput:
    kind: str                              # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    slo: SLO
    slo_class: str
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    logprobs: int | None                   # top-n per token, or None
    skip_special_tokens: bool = True
    prompt_text: str | None = None


# ---- field checks --------------------------------------------------------------------------------
def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise BadRequest(f"'{name}' must be a number, got {type(v).__name__}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a finite number, got {v}", name)
    if v < lo or (lo_open and v == lo) or v > hi:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise BadRequest(f"'{name}' must be in {lo_s}, {hi}], got {_show(v)}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise BadRequest(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if v < lo:
        raise BadRequest(f"'{name}' must be >= {lo}, got {_show(v)}", name)
    if v > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {_show(v)}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _str(body: dict, name: str, limit: int = MAX_NAME_CHARS) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string, got {type(v).__name__}", name)
    if len(v) > limit:
        raise BadRequest(f"'{name}' is longer than {limit} characters", name)
    return v


def _neutral(body: dict, name: str, neutral: Any, what: str) -> None:
    v = body.get(name)
    if v is not None and v != neutral and not (neutral == {} and v == {}):
        raise BadRequest(f"'{name}' is not supported by laneserve ({what})", name)


def _check_fields(body: Any, allowed: set[str], required: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not all(isinstance(k, str) for k in body):
        raise BadRequest("field names must be strings")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        names = ", ".join(k if len(k) <= 40 else k[:40] + "..." for k in unknown[:5])
        raise BadRequest(f"unknown field(s): {names}{', ...' if len(unknown) > 5 else ''}",
                         unknown[0] if len(unknown[0]) <= 64 else None)
    for name in required:
        if body.get(name) is None:
            raise BadRequest(f"missing required field '{name}'", name)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(v) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in v):
        raise BadRequest(f"'stop' may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                         "characters each", "stop")
    return tuple(v)


def _stop_token_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise BadRequest("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    bad = next((t for t in v if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"stop token id {_show(bad)} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return tuple(v)


def _slo_ms(v: Any, what: str, param: str) -> float:
    """Seconds of a millisecond target: a finite number in (0, MAX_SLO_MS]."""
    if not is_real(v) or not 0 < v <= MAX_SLO_MS:
        raise BadRequest(f"{what} must be a number > 0 and <= {MAX_SLO_MS} (milliseconds), got {_show(v)}", param)
    return v / 1e3


def _slo(body: dict, headers: dict[str, str], defaults: ServerDefaults) -> tuple[SLO, str, int]:
    cls_name = body.get("slo_class")
    if cls_name is not None and not isinstance(cls_name, str):
        raise BadRequest("'slo_class' must be a string", "slo_class")
    base, priority = defaults.default_slo, 0
    unknown_class = False
    if cls_name is not None and cls_name != "default":
        cls = defaults.classes.get(cls_name)
        if cls is None:
            unknown_class = True
        else:
            base, priority = cls.slo.with_defaults(base), cls.priority
    ttft, tpot = base.ttft, base.tpot
    for header, key in (("x-slo-ttft-ms", "ttft"), ("x-slo-tpot-ms", "tpot")):
        raw = headers.get(header)
        if raw is not None:
            try:
                ms = float(raw)
            except ValueError:
                raise BadRequest(f"header {header} must be a number of milliseconds, got {_show(raw)}",
                                 header) from None
            s = _slo_ms(ms, f"header {header}", header)
            ttft, tpot = (s, tpot) if key == "ttft" else (ttft, s)
    slo = body.get("slo")
    if slo is not None:
        if not isinstance(slo, dict):
            raise BadRequest("'slo' must be an object like {\"ttft_ms\": 500, \"tpot_ms\": 50}", "slo")
        unknown = sorted(k for k in slo if k not in ("ttft_ms", "tpot_ms"))
        if unknown:
            raise BadRequest(f"unknown field(s) in 'slo': {', '.join(_show(k) for k in unknown[:5])} "
                             "(use ttft_ms, tpot_ms)", "slo")
        for key in ("ttft_ms", "tpot_ms"):
            v = slo.get(key)
            if v is None:
                continue
            if key == "ttft_ms":
                ttft = _slo_ms(v, f"'slo.{key}'", "slo")
            else:
                tpot = _slo_ms(v, f"'slo.{key}'", "slo")
    own = {k for h, k in (("x-slo-ttft-ms", "ttft_ms"), ("x-slo-tpot-ms", "tpot_ms")) if headers.get(h) is not None}
    own |= {k for k in ("ttft_ms", "tpot_ms") if isinstance(slo, dict) and slo.get(k) is not None}
    if unknown_class:
        if own != {"ttft_ms", "tpot_ms"}:
            # an unknown class is only a label; it cannot supply defaults
            known = ", ".join(["default", *sorted(defaults.classes)])
            raise BadRequest(f"unknown slo_class {_show(cls_name)} (known: {known}); a request may name another "
                             "class only when it sets both SLO targets itself", "slo_class")
        if len(cls_name) > MAX_LABEL_CHARS or not _LABEL.fullmatch(cls_name):
            raise BadRequest(f"an slo_class label must be 1-{MAX_LABEL_CHARS} characters of A-Z a-z 0-9 _ . : -",
                             "slo_class")
    prio = _int(body, "priority", None)
    return SLO(ttft, tpot), cls_name or "default", priority if prio is None else prio


def _stream_opts(body: dict, stream: bool) -> tuple[bool, bool]:
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(so, dict) or any(k not in ("include_usage", "continuous_usage_stats") for k in so):
        raise BadRequest("'stream_options' must be an object with 'include_usage' and/or "
                         "'continuous_usage_stats'", "stream_options")
    return _bool(so, "include_usage", False), _bool(so, "continuous_usage_stats", False)


def _text_limit(text_chars: int, max_model_len: int, param: str) -> None:
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if text_chars > limit:
        raise BadRequest(f"the prompt has {text_chars} characters, more than can fit this model's context "
                         f"of {max_model_len} tokens ({limit} characters)", param)


@dataclass(slots=True)
class _Checked:
    """The fields checked before the prompt is tokenized, so that a bad one costs no tokenization."""

    model: str
    sampling: dict[str, Any]               # SamplingParams keywords, all but max_tokens
    slo: SLO
    slo_class: str
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    skip_special_tokens: bool


def _check_common(body: dict, vocab_size: int, headers: dict[str, str], defaults: ServerDefaults,
                  has_tokenizer: bool, logprobs: int | None) -> _Checked:
    model = _str(body, "model")
    _neutral(body, "n", 1, "only n=1")
    _neutral(body, "presence_penalty", 0, "only 0")
    _neutral(body, "frequency_penalty", 0, "only 0")
    _neutral(body, "repetition_penalty", 1, "only 1")
    _neutral(body, "min_p", 0, "only 0")
    _neutral(body, "min_tokens", 0, "only 0")
    _neutral(body, "logit_bias", {}, "no logit_bias")
    stop = _stop(body)
    if stop and not has_tokenizer:
        raise BadRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    top_k = _int(body, "top_k", -1)
    if top_k == 0 or top_k >= vocab_size:      # 0 (vLLM) and k >= vocab mean "off"
        top_k = -1
    if top_k < -1:
        raise BadRequest(f"'top_k' must be -1 (off) or >= 1, got {top_k}", "top_k")
    temperature = _num(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    if temperature < GREEDY_TEMPERATURE:       # as vLLM: a sub-1e-5 temperature is greedy
        temperature = 0.0
    sampling = dict(temperature=temperature, top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=top_k,
                    seed=_int(body, "seed", None), stop=stop, stop_token_ids=_stop_token_ids(body, vocab_size),
                    ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs)
    stream = _bool(body, "stream", False)
    include_usage, continuous = _stream_opts(body, stream)
    slo, slo_class, priority = _slo(body, headers, defaults)
    _str(body, "user")
    return _Checked(model, sampling, slo, slo_class, priority, stream, include_usage, continuous,
                    _bool(body, "return_token_ids", False), _bool(body, "skip_special_tokens", True))


def _finish(body: dict, kind: str, c: _Checked, prompt_ids: list[int], max_model_len: int, vocab_size: int,
            kv_tokens: int, defaults: ServerDefaults, max_tokens_key: str, prompt_text: str | None) -> GenerateInput:
    """The prompt-dependent checks (vocabulary, context, KV) and the :class:`GenerateInput`."""
    if not prompt_ids:
        raise BadRequest("the prompt is empty", "prompt" if kind == "completion" else "messages")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {_show(bad)} is outside the vocabulary [0, {vocab_size})", "prompt")
    n_prompt = len(prompt_ids)
    room = max_model_len - n_prompt
    if room < 1:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt has {n_prompt} tokens, leaving no room for output.", "prompt")
    default_max = 16 if kind == "completion" else min(room, defaults.default_max_tokens)
    max_tokens = _int(body, max_tokens_key, None, lo=1)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = _int(body, "max_tokens", None, lo=1)
    max_tokens = default_max if max_tokens is None else max_tokens
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
    return GenerateInput(kind, c.model, prompt_ids, sampling, c.slo, c.slo_class, c.priority, c.stream,
                         c.include_usage, c.continuous_usage, c.return_token_ids, c.sampling["logprobs"],
                         c.skip_special_tokens, prompt_text)


def parse_completion(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
                     headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    _check_fields(body, COMPLETION_FIELDS, ("model", "prompt"))
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        _text_limit(len(prompt), max_model_len, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
    elif not (isinstance(prompt, list) and all(is_int(t) for t in prompt)):
        raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
    _neutral(body, "echo", False, "only echo=false")
    _neutral(body, "suffix", None, "no suffix")
    _neutral(body, "best_of", 1, "only best_of=1")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    checked = _check_common(body, vocab_size, headers, defaults, tokenizer is not None, logprobs)
    if isinstance(prompt, str):
        text, ids = prompt, list(tokenizer.encode(prompt))
    else:
        text, ids = None, list(prompt)
    return _finish(body, "completion", checked, ids, max_model_len, vocab_size, kv_tokens, defaults, "max_tokens",
                   text)


def _message_text(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or role not in _ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {_show(role)}", "messages")
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise BadRequest(f"messages[{i}].content has more than {MAX_CONTENT_PARTS} parts", "messages")
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise BadRequest(f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} entries",
                         "chat_template_kwargs")
    for k, v in kwargs.items():
        if k in _TEMPLATE_RESERVED or not k.isidentifier():
            raise BadRequest(f"'chat_template_kwargs' may not set {_show(k)}", "chat_template_kwargs")
        if not (v is None or isinstance(v, bool) or is_real(v)
                or isinstance(v, str) and len(v) <= MAX_NAME_CHARS):
            raise BadRequest(f"'chat_template_kwargs.{k}' must be null, a boolean, a finite number or a string of "
                             f"at most {MAX_NAME_CHARS} characters", "chat_template_kwargs")
    return kwargs


def _metadata(body: dict) -> None:
    md = body.get("metadata")
    if md is None:
        return
    if (not isinstance(md, dict) or len(md) > MAX_METADATA
            or not all(len(k) <= MAX_METADATA_KEY_CHARS and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS
                       for k, v in md.items())):
        raise BadRequest(f"'metadata' must be an object of at most {MAX_METADATA} string values (keys <= "
                         f"{MAX_METADATA_KEY_CHARS} characters, values <= {MAX_METADATA_VALUE_CHARS})", "metadata")


def parse_chat(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
               headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    _check_fields(body, CHAT_FIELDS, ("model", "messages"))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' may hold at most {MAX_MESSAGES} messages", "messages")
    msgs = [_message_text(m, i) for i, m in enumerate(messages)]
    _text_limit(sum(len(m["content"]) for m in msgs), max_model_len, "messages")
    if body.get("tools"):
        raise BadRequest("'tools' is not supported by laneserve", "tools")
    _neutral(body, "tool_choice", "none", "no tools")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    _bool(body, "parallel_tool_calls", True)
    _bool(body, "store", False)
    _str(body, "service_tier")
    _metadata(body)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _template_kwargs(body)
    checked = _check_common(body, vocab_size, headers, defaults, True, logprobs)
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False,
                                             add_generation_prompt=_bool(body, "add_generation_prompt", True),
                                             **kwargs)
    except BadRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise BadRequest(f"the chat template failed on these messages: {_show(str(exc), 200)}", "messages") from None
    if not isinstance(text, str):
        raise BadRequest("the chat template did not produce text", "messages")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return _finish(body, "chat", checked, ids, max_model_len, vocab_size, kv_tokens, defaults,
                   "max_completion_tokens", text)
