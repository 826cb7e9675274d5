"""OpenAI-compatible request validation (issue 6, items 2-4): request bodies of
``/v1/completions`` and ``/v1/chat/completions`` become one :class:`GenerateInput`, or a
:class:`BadRequest` (HTTP 400) whose message names the field and what is wrong.

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

from dataclasses import dataclass, field
from typing import Any

from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO, SLOClass


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
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise BadRequest(f"'{name}' must be a number, got {type(v).__name__}", name)
    if lo is not None and (v < lo or (lo_open and v == lo)) or hi is not None and v > hi:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise BadRequest(f"'{name}' must be in {lo_s}, {hi}], got {v}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise BadRequest(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if lo is not None and v < lo:
        raise BadRequest(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _neutral(body: dict, name: str, neutral: Any, what: str) -> None:
    v = body.get(name)
    if v is not None and v != neutral and not (neutral == {} and v == {}):
        raise BadRequest(f"'{name}' is not supported by laneserve ({what})", name)


def _check_fields(body: Any, allowed: set[str], required: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", unknown[0])
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
    return tuple(v)


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
                raise BadRequest(f"header {header} must be a number of milliseconds, got {raw!r}", header) from None
            if not ms > 0:
                raise BadRequest(f"header {header} must be > 0 ms, got {raw!r}", header)
            ttft, tpot = (ms / 1e3, tpot) if key == "ttft" else (ttft, ms / 1e3)
    slo = body.get("slo")
    if slo is not None:
        if not isinstance(slo, dict):
            raise BadRequest("'slo' must be an object like {\"ttft_ms\": 500, \"tpot_ms\": 50}", "slo")
        unknown = sorted(set(slo) - {"ttft_ms", "tpot_ms"})
        if unknown:
            raise BadRequest(f"unknown field(s) in 'slo': {', '.join(unknown)} (use ttft_ms, tpot_ms)", "slo")
        for key in ("ttft_ms", "tpot_ms"):
            v = slo.get(key)
            if v is None:
                continue
            if not _is_num(v) or not v > 0:
                raise BadRequest(f"'slo.{key}' must be a number > 0 (milliseconds), got {v!r}", "slo")
            if key == "ttft_ms":
                ttft = v / 1e3
            else:
                tpot = v / 1e3
    own = {k for h, k in (("x-slo-ttft-ms", "ttft_ms"), ("x-slo-tpot-ms", "tpot_ms")) if headers.get(h) is not None}
    own |= {k for k in ("ttft_ms", "tpot_ms") if isinstance(slo, dict) and slo.get(k) is not None}
    if unknown_class and own != {"ttft_ms", "tpot_ms"}:
        # an unknown class is only a label; it cannot supply defaults
        known = ", ".join(["default", *sorted(defaults.classes)])
        raise BadRequest(f"unknown slo_class {cls_name!r} (known: {known}); a request may name another class "
                         "only when it sets both SLO targets itself", "slo_class")
    prio = body.get("priority")
    if prio is not None:
        if not _is_int(prio):
            raise BadRequest("'priority' must be an integer", "priority")
        priority = prio
    return SLO(ttft, tpot), cls_name or "default", priority


def _stream_opts(body: dict, stream: bool) -> tuple[bool, bool]:
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("'stream_options' must be an object with 'include_usage' and/or "
                         "'continuous_usage_stats'", "stream_options")
    return _bool(so, "include_usage", False), _bool(so, "continuous_usage_stats", False)


def _common(body: dict, kind: str, prompt_ids: list[int], max_model_len: int, vocab_size: int,
            kv_tokens: int, headers: dict[str, str], defaults: ServerDefaults, has_tokenizer: bool,
            max_tokens_key: str, logprobs: int | None, prompt_text: str | None) -> GenerateInput:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    if not prompt_ids:
        raise BadRequest("the prompt is empty", "prompt" if kind == "completion" else "messages")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    _neutral(body, "n", 1, "only n=1")
    _neutral(body, "presence_penalty", 0, "only 0")
    _neutral(body, "frequency_penalty", 0, "only 0")
    _neutral(body, "repetition_penalty", 1, "only 1")
    _neutral(body, "min_p", 0, "only 0")
    _neutral(body, "min_tokens", 0, "only 0")
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported by laneserve", "logit_bias")
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
    stop = _stop(body)
    if stop and not has_tokenizer:
        raise BadRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids)):
        raise BadRequest("'stop_token_ids' must be a list of integers", "stop_token_ids")
    top_k = _int(body, "top_k", -1)
    if top_k == 0:
        top_k = -1
    if top_k is not None and top_k < -1:
        raise BadRequest(f"'top_k' must be -1 (off) or >= 1, got {top_k}", "top_k")
    sampling = SamplingParams(max_tokens=max_tokens,
                              temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                              top_k=top_k, seed=_int(body, "seed", None), stop=stop,
                              stop_token_ids=tuple(stop_ids or ()), ignore_eos=_bool(body, "ignore_eos", False),
                              logprobs=logprobs)
    stream = _bool(body, "stream", False)
    include_usage, continuous = _stream_opts(body, stream)
    slo, slo_class, priority = _slo(body, headers, defaults)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", "user")
    return GenerateInput(kind, model, prompt_ids, sampling, slo, slo_class, priority, stream, include_usage,
                         continuous, _bool(body, "return_token_ids", False), logprobs,
                         _bool(body, "skip_special_tokens", True), prompt_text)


def parse_completion(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
                     headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    _check_fields(body, COMPLETION_FIELDS, ("model", "prompt"))
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a batch of one
    text = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        text = prompt
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
    _neutral(body, "echo", False, "only echo=false")
    _neutral(body, "suffix", None, "no suffix")
    _neutral(body, "best_of", 1, "only best_of=1")
    logprobs = _int(body, "logprobs", None, lo=0, hi=20)
    return _common(body, "completion", ids, max_model_len, vocab_size, kv_tokens, headers, defaults,
                   tokenizer is not None, "max_tokens", logprobs, text)


def _message_text(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in _ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": role, "content": content}


def parse_chat(body: Any, *, tokenizer, max_model_len: int, vocab_size: int, kv_tokens: int,
               headers: dict[str, str], defaults: ServerDefaults) -> GenerateInput:
    _check_fields(body, CHAT_FIELDS, ("model", "messages"))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    msgs = [_message_text(m, i) for i, m in enumerate(messages)]
    if body.get("tools"):
        raise BadRequest("'tools' is not supported by laneserve", "tools")
    _neutral(body, "tool_choice", "none", "no tools")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, lo=0, hi=20)
    elif body.get("top_logprobs") is not None:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False,
                                             add_generation_prompt=_bool(body, "add_generation_prompt", True),
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise BadRequest(f"the chat template failed on these messages: {exc}", "messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return _common(body, "chat", ids, max_model_len, vocab_size, kv_tokens, headers, defaults, True,
                   "max_completion_tokens", logprobs, text)


def parse_body(raw: bytes) -> Any:  # TEMPORARY stand-in until the validation branch lands
    import json
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}") from None
