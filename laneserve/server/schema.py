"""Typed request and response bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic
v2): what a request may hold, each field's type, range and size limit, and what the server answers.
``/openapi.json`` and ``/docs`` are generated from these models.

The request models check everything that depends on the body alone — types (strict: no ``"8"``
for 8, no ``true`` for 1), ranges, finiteness, int64 bounds, lengths — as field constraints; what
depends on the served model (vocabulary, context length, tokenizer, SLO classes, headers) is checked
by ``laneserve.server.protocol``, which turns a validated model into a ``GenerateInput``. Every
limit is a named constant below: each is far beyond what a legitimate client sends, and small
enough that no single request can make the server recurse, allocate, compute or echo without bound.

Unknown fields are ignored (as vLLM, which logs them: ``protocol`` logs each name once). Fields of
OpenAI's and vLLM's APIs that laneserve does not implement (``suffix``,
``spaces_between_special_tokens``) are typed here and refused by ``protocol`` unless neutral.

The response models document the JSON bodies (``responses=`` of the routes) and let tests check a
live server's answers against them; the handlers build plain dicts, so a request pays nothing for
them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from laneserve.core.sampling import (INT64_MAX, INT64_MIN, MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PENALTY,
                                     MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY)

# ---- limits ------------------------------------------------------------------------------------
# Every accepted int fits the wire (msgpack int64): seeds and priorities are int64 like vLLM's seed.
MAX_JSON_DEPTH = 32            # nested arrays/objects in a body; a chat request with text parts needs 5
MAX_TEMPERATURE = 2.0          # OpenAI's range [0, 2]; below GREEDY_TEMPERATURE (1e-5) is greedy
MAX_STOP_STRINGS = 16          # OpenAI allows 4
MAX_STOP_CHARS = 256           # per stop string (the stop checker decodes ~2x this many tokens a step)
MAX_STOP_TOKEN_IDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18   # allowed_token_ids (a vocabulary's worth)
MAX_CHARS_PER_TOKEN = 64       # prompt text beyond max_model_len * this cannot fit the context
MAX_PROMPT_IDS = 1 << 20       # a token-id prompt (the context length bounds it further)
MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 1024       # text parts of one message
MAX_NAME_CHARS = 1024          # 'model', 'user', 'service_tier', chat template string values
MAX_LABEL_CHARS = 64           # an slo_class that is only a label (it becomes a metrics label)
MAX_SLO_MS = 86_400_000        # one day, for slo.ttft_ms / slo.tpot_ms and the x-slo-*-ms headers
MAX_TEMPLATE_KWARGS = 16       # chat_template_kwargs entries, scalar values, strings <= MAX_NAME_CHARS
MAX_METADATA = 16              # OpenAI's metadata limits: 16 pairs, keys <= 64 chars, values <= 512
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
MAX_BATCH_PROMPTS = 64         # prompts of one /v1/completions request
MAX_TOOLS = 128
MAX_REGEX_CHARS = 4096         # guided_regex / structured_outputs.regex
MAX_CHOICES = 256              # guided_choice options

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# Token ids (prompt, stop_token_ids) are plain ints here: protocol checks them against the served
# model's vocabulary, naming the bad id (within a union, a bounded int would only say no member matched).
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
_TOKEN_KEY = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,19}$")]   # a token id as a JSON key
_TEMPLATE_VALUE = None | bool | int | float | Name

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class SLOTargets(BaseModel):
    """laneserve's per-request SLO targets (milliseconds); a typo here is refused, not ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    ttft_ms: Annotated[float, Field(gt=0, le=MAX_SLO_MS, description="time-to-first-token target")] | None = None
    tpot_ms: Annotated[float, Field(gt=0, le=MAX_SLO_MS, description="time-per-output-token target")] | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(False, description="a last chunk with the request's token usage")
    continuous_usage_stats: bool = Field(False, description="usage in every chunk (vLLM)")


class _Request(BaseModel):
    """Fields shared by completions and chat completions: OpenAI's, vLLM's sampling extensions
    and laneserve's SLO extensions."""

    model_config = _STRICT
    model: Name | None = Field(None, description="the served model (optional: the server's first served name)")
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="output tokens at most (completions: 16 by default, 0 only with echo: the prompt and "
                          "its logprobs alone; chat: >= 1, the context left by default, capped at the server's "
                          "--default-max-tokens)")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        None, description="1 by default; below 1e-5 is greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        None, description="choices per prompt (the prompt is prefilled once for all of them)")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="stop strings (need a tokenizer); not part of the output")
    seed: Int64 | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = Field(
        None, description="subtracted once from the logit of every token already in the output")
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = Field(
        None, description="times a token's count in the output, subtracted from its logit")
    logit_bias: Annotated[dict[_TOKEN_KEY, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (a decimal string) -> bias added to its logit")
    user: Name | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = Field(None, description="-1 or 0: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="drop tokens less likely than min_p times the likeliest (after temperature); 0: off")
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = Field(
        None, description="over prompt and output: a seen token's positive logit is divided by it, a negative one "
                          "multiplied")
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="EOS, stop_token_ids and stop strings are ignored until this many tokens")
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = Field(None, description="only true (vLLM's default)")
    include_stop_str_in_output: bool | None = Field(None, description="keep the matched stop string in the output")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="keep only the last k prompt tokens (-1: the model's context length)")
    allowed_token_ids: Annotated[list[int], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = Field(
        None, description="only these tokens may be sampled (empty: all)")
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="words the output may not contain (as vLLM: their tokens, with and without a leading "
                          "space)")
    return_token_ids: bool | None = Field(None, description="token ids of the prompt and the output in each choice")
    priority: Int64 | None = Field(None, description="lower = served earlier by priority-aware policies")
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="vLLM: the logprob of each prompt token and the top-n at its position (completions: "
                          "in each choice; chat: once, beside the choices, and not with stream)")
    # structured output (OpenAI's response_format; vLLM's guided_* and structured_outputs)
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}')
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema the output must satisfy")
    guided_regex: Annotated[str, StringConstraints(max_length=MAX_REGEX_CHARS)] | None = Field(
        None, description="a regex the output must match in full")
    guided_choice: Annotated[list[Name], Field(max_length=MAX_CHOICES)] | None = Field(
        None, description="the output is exactly one of these")
    guided_grammar: str | None = Field(None, description="a context-free grammar: Lark, or GBNF (root ::= ...)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: one of json, regex, choice, grammar, json_object")
    # laneserve extensions
    slo: SLOTargets | None = None
    slo_class: str | None = Field(None, description="a --slo-class of the server, or a label when slo sets both "
                                                    "targets")


class CompletionRequest(_Request):
    """The body of ``POST /v1/completions``."""

    prompt: (str | Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]
             | Annotated[list[str], Field(max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]],
                         Field(max_length=MAX_BATCH_PROMPTS)]) = Field(
        description="text, a list of token ids, or a batch: a list of texts or of token-id lists (choice i * n + j "
                    "is sample j of prompt i)")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="top-n logprobs of each output token")
    echo: bool | None = Field(None, description="the prompt before the completion")
    suffix: str | None = Field(None, description="not supported")
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        None, description="samples per prompt (>= n), of which the n with the highest cumulative logprob are "
                          "returned; not with stream")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ToolCallFunctionIn(BaseModel):
    model_config = _STRICT
    name: Name
    arguments: str | dict[str, Any] = Field(description="JSON text of an object (as OpenAI sends it), or the object")


class ToolCallIn(BaseModel):
    """A call the assistant made, sent back in the conversation."""

    model_config = _STRICT
    id: Name | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, description="may be null (or absent) only in an assistant message with tool_calls")
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="assistant: the calls it made (rendered by the chat template)")
    tool_call_id: Name | None = Field(None, description="tool: the id of the call this message answers")


class ChatCompletionRequest(_Request):
    """The body of ``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = Field(
        None, description="output tokens at most; takes precedence over max_tokens")
    logprobs: bool | None = Field(None, description="logprobs of each output token")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(None, description="needs logprobs")
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (no constraint), "required", or {"type": "function", "function": '
                          '{"name": ...}}: the output is constrained to the call(s)')
    parallel_tool_calls: bool | None = Field(None, description='with "required": false allows one call only')
    add_generation_prompt: bool | None = Field(None, description="true by default")
    chat_template_kwargs: Annotated[dict[str, _TEMPLATE_VALUE], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = Field(
        None, description="extra variables of the chat template (not its own arguments)")
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)],
                             Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]],
                        Field(max_length=MAX_METADATA)] | None = None
    store: bool | None = None
    service_tier: Name | None = None
    echo: bool | None = Field(None, description="vLLM: the last message's content before the reply when that "
                                                "message is the assistant's")
    continue_final_message: bool | None = Field(
        None, description="vLLM: the reply continues the last (assistant) message instead of starting a new one "
                          "(not with add_generation_prompt: true)")


# ---- responses (documentation and tests; handlers build dicts) ------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose KV was found in the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(None, description="with tool_choice naming a function or "
                                                                   '"required"')


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
