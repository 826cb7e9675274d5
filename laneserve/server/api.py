"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/debug/state`` (per-instance KV blocks,
queues and liveness, for tests and operators). ``/openapi.json`` and ``/docs`` describe the request
and response bodies with the models of :mod:`laneserve.server.schema`; the handlers read the raw
body themselves (never FastAPI's own parsing and 422s), so every refusal is a 400 in OpenAI's shape.

Requests pass :class:`EdgeGuard` first (API key, 401; body size, 413 before anything is parsed),
are parsed and validated by :mod:`laneserve.server.protocol` (400 with a clear message) in a
thread pool — tokenization and chat templates never run on the event loop —, admitted by the
router (:class:`~laneserve.cluster.process.ProcessCluster`: 429 + ``Retry-After`` when
overloaded, 503 when no instance can serve) and answered from the per-request event queue, either
as one JSON body or as server-sent events ending in ``data: [DONE]`` (with a usage chunk when
``stream_options.include_usage`` is set).

The admission slot (the request's entry in the router) has one owner: the handler that took it
releases it in a ``finally`` — for a stream, :class:`_OwnedStream` does, whether the stream
finished, failed, was never started or the client went away — so no path leaks a slot. A client
that disconnects cancels its request on the instance that holds it, which frees its KV.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from laneserve.cluster.process import Overloaded, ProcessCluster, Track, Unavailable
from laneserve.server import budget
from laneserve.server.encode import encode_json
from laneserve.server.detok import IncrementalDetokenizer, stop_reason, token_text
from laneserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from laneserve.server.metrics import ServerMetrics
from laneserve.server.protocol import (BadRequest, GenerateInput, PromptInput, ServerDefaults, parse_body,
                                      parse_chat, parse_completion)
from laneserve.server.schema import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse)
from laneserve.server.structured import ToolCallStream, call_id, openai_tool_calls, tool_finish_reason
from laneserve.server.extras import install_extras
from laneserve.server.tool_parsers import AutoToolStream, get_parser


@dataclass(slots=True)
class ServerState:
    cluster: ProcessCluster
    model_name: str
    model_path: str
    tokenizer: Any
    defaults: ServerDefaults
    metrics: ServerMetrics
    api_key: str | None = None
    protect_all: bool = False             # also /health, /version, /metrics and the docs need the key
    metrics_require_key: bool = False     # /metrics needs the key (it is open by default, for scrapers)
    max_request_bytes: int = 8 << 20
    body_timeout: float = 30.0            # seconds a request body may take to arrive (408 after)
    request_budget: budget.RequestBudget = field(default_factory=budget.RequestBudget)
    # "starting" while the instances load (requests get 503 + Retry-After), then "ready"
    phase: str = "ready"
    # tokenization and chat templates run here, not on the event loop (tokenizers release the GIL)
    parse_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="laneserve-parse"))
    # large responses (echo, logprobs) are built and serialised here, not on the event loop
    render_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="laneserve-render"))


def parse_request(kind: str, raw: bytes, **kw) -> GenerateInput:
    """Body bytes -> :class:`GenerateInput` (JSON decoding, validation, chat template, tokenization):
    the CPU-heavy part of a request, run in the parse pool."""
    body = parse_body(raw)
    return (parse_completion if kind == "completion" else parse_chat)(body, **kw)


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status, headers=headers)


# paths that do no work for a client: open even with an API key (``/metrics`` unless
# ``metrics_require_key``); every other path (the API, /tokenize, /detokenize, /debug, unknown paths) needs it
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def needs_key(state: ServerState, path: str) -> bool:
    """Whether a request to ``path`` must carry the API key (when the server has one)."""
    if state.protect_all:
        return True
    if path == "/metrics":
        return state.metrics_require_key
    return path not in OPEN_PATHS


class EdgeGuard:
    """ASGI middleware at the edge: the API key (vLLM's ``--api-key``: ``Authorization: Bearer KEY``
    on every path that does work, see :func:`needs_key`; every path with ``protect_all``) and the
    body-size limit (413 from ``Content-Length`` before a byte of the body is read; bodies without
    it are counted as they arrive and cut at the limit)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        headers = dict(scope["headers"])
        if st.api_key and needs_key(st, path):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), st.api_key.encode()):
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      "AuthenticationError", headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        limit = st.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                return await error_response(400, "invalid Content-Length header", "BadRequestError")(
                    scope, receive, send)
            if too_big:
                return await self._too_big(scope, receive, send)
        return await self.app(scope, _capped(receive, limit, st.body_timeout), send)

    async def _too_big(self, scope, receive, send) -> None:
        self.state.metrics.reject("too_large")
        await error_response(413, f"request body larger than {self.state.max_request_bytes} bytes "
                                  "(--max-request-bytes)", "RequestTooLargeError")(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


def _capped(receive, limit: int, timeout: float):
    """``receive`` that raises :class:`BodyTooLarge` once more than ``limit`` body bytes arrived,
    and :class:`BodyTimeout` when the body is not complete ``timeout`` seconds after the handler
    first asked for it (a client trickling its body holds a connection and a task)."""
    seen = 0
    complete = False
    deadline: float | None = None

    async def wrapped():
        nonlocal seen, complete, deadline
        if complete:                    # after the body: disconnect watches wait as long as they like
            return await receive()
        if deadline is None:
            deadline = time.monotonic() + timeout
        try:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BodyTimeout from None
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise BodyTooLarge
            complete = not msg.get("more_body", False)
        else:
            complete = True
        return msg
    return wrapped


class _OwnedStream(StreamingResponse):
    """A streaming response that releases its request's admission slot however it ends."""

    def __init__(self, content, release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


_ERROR_TYPES = {400: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 400: "BadRequestError"}
# a streamed chunk bigger than this (tokens x alternatives, or any echo / prompt logprobs) is built
# and serialised off the event loop
_HEAVY_CHUNK_ENTRIES = 2000


def _starting() -> JSONResponse:
    return error_response(503, "the server is starting: its instances are still loading", "ServiceUnavailableError",
                          headers={"Retry-After": "2"})


def _sse(obj: Any, big: bool = False) -> str:
    """One server-sent event; ``big``: encoded in pieces (:mod:`laneserve.server.encode`), for a
    chunk built in the render pool."""
    text = encode_json(obj).decode() if big else json.dumps(obj, separators=(",", ":"))
    return f"data: {text}\n\n"


class _Run:
    """One choice's output as it arrives (a sample of one prompt): text, tokens, logprobs, metrics
    observations."""

    def __init__(self, state: ServerState, gi: GenerateInput, track: Track, prompt: PromptInput, index: int) -> None:
        self.state, self.gi, self.track, self.prompt, self.index = state, gi, track, prompt, index
        self.detok = IncrementalDetokenizer(state.tokenizer, gi.sampling.stop, gi.skip_special_tokens,
                                            gi.sampling.min_tokens, gi.include_stop_str)
        self.finish: str | None = None
        self.error: str | None = None
        self.error_status = 500
        self.n_tokens = 0
        self.cum_logprob = 0.0                # of the tokens kept (best_of ranks samples by it)
        self.toks: list[int] = []             # all tokens and logprobs, for a complete (not streamed) answer
        self.lps: list = []
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.queue_time: float | None = None
        self.cached_tokens = 0                   # prompt tokens the prefill found in its prefix cache
        self.prompt_lps: list | None = None      # prompt logprobs (entries for prompt tokens 1, 2, ...)

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None

    async def next_event(self) -> tuple[list[int], list | None]:
        """The next tokens (and their logprobs); sets ``finish``/``error`` when the request ends."""
        ev = await self.track.events.get()
        if ev[0] == "err":
            self.error, self.error_status = ev[1], ev[2]
            return [], None
        _, toks, finish, lp, info = ev
        if self.gi.echo_only:               # echo with max_tokens 0: the prompt (and its logprobs) only
            toks, lp = [], None
        now = self.state.cluster.clock.now()
        m = self.state.metrics
        if toks:
            if self.t_first is None:
                self.t_first = now
                m.ttft.observe(now - self.track.request.arrival_time)
            else:
                m.itl.observe(now - self.t_last)
            self.t_last = now
        if info and info.get("prefill_start") is not None and self.queue_time is None:
            self.queue_time = max(0.0, info["prefill_start"] - self.track.request.arrival_time)
            m.queue.observe(self.queue_time)
        if info and info.get("cached"):
            self.cached_tokens = int(info["cached"])
        if info and info.get("plp") is not None and self.prompt_lps is None:
            self.prompt_lps = info["plp"]
        self.detok.add(toks)
        if self.detok.stopped and finish is None:
            finish = "stop"
            self.state.cluster.abort(self.track.rid)
        n_before = self.n_tokens
        self.n_tokens = len(self.detok.ids)
        if lp is not None:
            lp = lp[: self.n_tokens - n_before]
            self.cum_logprob += sum(x[0] for x in lp)
        self.finish = finish
        if finish is not None:
            self._on_finish(now)
        return toks[: self.n_tokens - n_before], lp

    def _on_finish(self, now: float) -> None:
        m, req = self.state.metrics, self.track.request
        e2e = now - req.arrival_time
        m.e2e.observe(e2e)
        m.success.labels(m.model, self.finish).inc()
        m.generation_tokens.inc(self.n_tokens)
        ttft = (self.t_first or now) - req.arrival_time
        tpot = (e2e - ttft) / (self.n_tokens - 1) if self.n_tokens > 1 else None
        if tpot is not None:
            m.tpot.observe(tpot)
        if self.queue_time is not None and self.t_first is not None:
            start = req.arrival_time + self.queue_time
            m.phase["prefill"].observe(max(0.0, self.t_first - start))
            m.phase["decode"].observe(now - self.t_first)
            m.phase["inference"].observe(max(0.0, now - start))
        if req.slo.ttft is not None or req.slo.tpot is not None:
            ok_ttft = req.slo.ttft is None or ttft <= req.slo.ttft
            ok_tpot = req.slo.tpot is None or tpot is None or tpot <= req.slo.tpot
            m.slo_total.labels(m.model, req.slo_class).inc()
            for name, ok in (("ttft", ok_ttft), ("tpot", ok_tpot), ("both", ok_ttft and ok_tpot)):
                if ok:
                    m.slo_met.labels(m.model, req.slo_class, name).inc()

    def echo_logprobs(self, completion: dict | None) -> dict | None:
        """OpenAI's logprobs of an echoed completion: the prompt's tokens first (the first one has
        no logprob), then ``completion``'s (its offsets already past the prompt text)."""
        if self.gi.logprobs is None or self.prompt_lps is None:
            return completion
        k, ids = self.gi.logprobs, self.prompt.ids
        first = token_text(self.state.tokenizer, ids[0])
        rest = self.logprobs_block(ids[1:], [[e[0], e[1][:k]] for e in self.prompt_lps], len(first))
        block = {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                 "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
        if completion is not None:
            for key in block:
                block[key] = block[key] + completion[key]
        return block

    def vllm_prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else a map from token id
        to ``{logprob, rank, decoded_token}`` holding the token itself and the top ``prompt_logprobs``."""
        k, tok = self.gi.prompt_logprobs, self.state.tokenizer
        if k is None or self.prompt_lps is None:
            return None
        out: list = [None]
        for t, e in zip(self.prompt.ids[1:], self.prompt_lps):
            logprob, top = e[0], e[1]
            entry: dict[str, dict] = {}
            ranks = {i: r for r, (i, _) in enumerate(top, 1)}
            rank = e[2] if len(e) > 2 else ranks.get(t)        # the engine's rank (over the whole vocabulary)
            entry[str(t)] = {"logprob": logprob, "rank": rank, "decoded_token": token_text(tok, t)}
            for i, v in top[:k]:
                entry.setdefault(str(i), {"logprob": v, "rank": ranks[i], "decoded_token": token_text(tok, i)})
            out.append(entry)
        return out

    def logprobs_block(self, toks: list[int], lp: list | None, offset: int) -> Any:
        """The OpenAI logprobs of ``toks`` (``lp`` entries ``[logprob, [[id, logprob], ...]]``)."""
        if self.gi.logprobs is None or lp is None:
            return None
        tok = self.state.tokenizer
        if self.gi.kind == "chat":
            content = []
            for t, (logprob, top) in zip(toks, lp):
                s = token_text(tok, t)
                content.append({"token": s, "logprob": logprob, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": token_text(tok, i), "logprob": v,
                                                  "bytes": list(token_text(tok, i).encode())} for i, v in top]})
            return {"content": content}
        tokens = [token_text(tok, t) for t in toks]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [x[0] for x in lp],
                "top_logprobs": [{token_text(tok, i): v for i, v in x[1]} for x in lp], "text_offset": offsets}


def _usage(gi: GenerateInput, runs: list[_Run]) -> dict[str, Any]:
    """Token usage of a request: each prompt once, the output of each returned choice, and the
    prompt tokens found in a prefix cache (each prompt once: its samples share one prefill)."""
    p = sum(len(x.ids) for x in gi.prompts)
    c = sum(r.n_tokens for r in runs)
    cached: dict[int, int] = {}
    for r in runs:
        cached[id(r.prompt)] = max(cached.get(id(r.prompt), 0), r.cached_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _best(gi: GenerateInput, runs: list[_Run]) -> list[_Run]:
    """The choices returned: per prompt, the n samples with the highest cumulative logprob
    (best_of > n, as vLLM), else every sample; choice indices follow this order."""
    per_prompt = len(runs) // len(gi.prompts)
    if per_prompt == gi.n:
        return runs
    out = []
    for i in range(len(gi.prompts)):
        group = runs[i * per_prompt:(i + 1) * per_prompt]
        out += sorted(group, key=lambda r: r.cum_logprob, reverse=True)[:gi.n]
    return out


async def _merged_events(runs: list[_Run]):
    """Every run's events as they arrive: ``(run, tokens, logprobs)`` until each run ended."""
    pending = {asyncio.ensure_future(r.next_event()): r for r in runs}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f].index):
                run = pending.pop(fut)
                toks, lp = fut.result()
                yield run, toks, lp
                if not run.done:
                    pending[asyncio.ensure_future(run.next_event())] = run
    finally:
        for fut in pending:
            fut.cancel()


_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (400, "invalid request: the message names the field"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "body larger than --max-request-bytes"),
        (429, "overloaded (Retry-After)"), (503, "no instance can serve"))}


def _documented(request_model, response_model) -> dict[str, Any]:
    """Route arguments that document a body the handler parses itself (``openapi_extra``)."""
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request_model.__name__}"}}}}},
            "responses": {200: {"model": response_model, "description": "the completion, or server-sent events "
                                "ending in data: [DONE] with stream: true",
                                "content": {"text/event-stream": {}}}, **_ERRORS}}


def _install_openapi(app: FastAPI) -> None:
    """FastAPI's schema plus the request models (handlers take the raw body, so FastAPI does not
    see them)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="OpenAI-compatible completions and chat completions")
            _, defs = models_json_schema([(m, "validation") for m in _REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def build_app(state: ServerState, lifespan=None) -> EdgeGuard:
    """The ASGI app over ``state``: the OpenAI routes, the info routes (models, health, metrics,
    debug state), OpenAI-shaped HTTP errors and the extra endpoints, behind the edge guard."""
    app = FastAPI(title="laneserve", lifespan=lifespan)
    app.state.ls = state
    _install_openapi(app)
    _add_generate_routes(app, state)
    _add_info_routes(app, state)
    _add_error_handlers(app)
    install_extras(app, state)
    return EdgeGuard(app, state)


def _add_generate_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""
    @app.post("/v1/completions", **_documented(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions", **_documented(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models``, ``/health``, ``/metrics`` and ``/debug/state``."""
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> JSONResponse:
        if state.phase != "ready":
            return _starting()
        lim = state.cluster.limits
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "laneserve",
            "root": state.model_path,
            "max_model_len": min(lim["max_model_len"], state.defaults.max_model_len or lim["max_model_len"]),
            "vocab_size": lim["vocab_size"]}]})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 ``ok`` or ``degraded`` (some instances down or restarting, every role still served);
        503 ``unavailable`` when a role has no instance left or the server is shutting down, and
        ``starting`` while the instances load."""
        if state.phase != "ready":
            return JSONResponse({"status": state.phase}, status_code=503, headers={"Retry-After": "2"})
        h = state.cluster.health()
        return JSONResponse(h, status_code=503 if h["status"] == "unavailable" else 200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        c = state.cluster
        insts = []
        for h in c.instances:
            s = h.stats
            insts.append({"id": h.instance_id, "role": h.role, "running": s.get("running"),
                          "waiting": s.get("waiting"), "kv_usage": s.get("kv_usage"), "kv_free": s.get("kv_free"),
                          "kv_total": s.get("kv_total"), "preemptions": s.get("preemptions"),
                          "prefix_queries": s.get("prefix_queries"), "prefix_hits": s.get("prefix_hits"),
                          "alive": 1 if h.alive else 0,
                          "tensor_parallel_size": h.info.tensor_parallel_size if h.info is not None else None})
        return Response(state.metrics.render(insts, len(c.tracks)), media_type=METRICS_CONTENT_TYPE)

    @app.api_route("/debug/state", methods=["GET", "HEAD"])
    async def debug_state() -> JSONResponse:
        return JSONResponse({"model": state.model_name, **state.cluster.state()})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown paths and methods in OpenAI's error shape (404 / 405)."""
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"{request.method} {request.url.path}: no such endpoint"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, detail, _HTTP_ERROR_TYPES.get(exc.status_code, "APIError"),
                              headers=getattr(exc, "headers", None))


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    """One completions / chat completions request: read and check it, submit its prompts, answer
    (streamed or whole); the requests' slots are released however it ends."""
    if state.phase != "ready":
        return _starting()
    gi = await _read_input(state, request, kind)
    if isinstance(gi, Response):
        return gi
    runs = _submit(state, gi)
    if isinstance(runs, Response):
        return runs

    def release() -> None:                 # the slots' one owner: a no-op once finished
        for run in runs:
            state.cluster.abort(run.track.rid)
    handed_over = False
    try:
        state.metrics.prompt_tokens.inc(sum(len(p.ids) for p in gi.prompts))
        if gi.stream:
            resp = _OwnedStream(_stream(state, gi, runs), release, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
            handed_over = True
            return resp
        return await _complete(state, request, gi, runs)
    finally:
        if not handed_over:
            release()


async def _read_input(state: ServerState, request: Request, kind: str) -> GenerateInput | Response:
    """The request's parsed input, or the error response (413, 408, 499, 400, 404) that ends it."""
    st = state
    try:
        try:
            raw = await request.body()
        except BodyTooLarge:
            st.metrics.reject("too_large")
            return error_response(413, f"request body larger than {st.max_request_bytes} bytes "
                                       "(--max-request-bytes)", "RequestTooLargeError")
        except BodyTimeout:
            st.metrics.reject("bad_request")
            return error_response(408, f"the request body did not arrive within {st.body_timeout:g} s",
                                  "RequestTimeoutError", headers={"Connection": "close"})
        except ClientDisconnect:            # the client closed mid-body: nobody to answer
            return Response(status_code=499)
        limits = st.cluster.limits
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-slo-")}
        parse = partial(parse_request, kind, raw, tokenizer=st.tokenizer,
                        max_model_len=limits["max_model_len"], vocab_size=limits["vocab_size"],
                        kv_tokens=limits["kv_tokens"], headers=headers, defaults=st.defaults)
        gi = await asyncio.get_running_loop().run_in_executor(st.parse_pool, parse)
    except BadRequest as exc:
        st.metrics.reject("bad_request")
        return error_response(400, str(exc), "BadRequestError", exc.param)
    if gi.model not in (st.model_name, st.model_path):
        return error_response(404, f"The model `{gi.model}` does not exist. Served: `{st.model_name}`.",
                              "NotFoundError", "model")
    try:
        _check_budget(state, gi)
    except budget.OverBudget as exc:
        st.metrics.reject("bad_request")
        return error_response(400, str(exc), "BadRequestError", exc.param)
    return gi


def _submit(state: ServerState, gi: GenerateInput) -> list[_Run] | Response:
    """Each prompt of ``gi`` submitted to the cluster (a batch: each prompt is a request of its
    own), or the 429 / 503 answer, with whatever was submitted aborted."""
    runs: list[_Run] = []
    try:
        for prompt in gi.prompts:
            tracks = state.cluster.submit(prompt.ids, gi.sampling, slo=gi.slo, slo_class=gi.slo_class,
                                          priority=gi.priority)
            runs += [_Run(state, gi, t, prompt, len(runs) + k) for k, t in enumerate(tracks)]
    except (Overloaded, Unavailable) as exc:
        for run in runs:
            state.cluster.abort(run.track.rid)
        if isinstance(exc, Overloaded):
            state.metrics.reject("overloaded")
            return error_response(429, str(exc), "RateLimitError", headers={"Retry-After": str(exc.retry_after)})
        state.metrics.reject("unavailable")
        return error_response(503, str(exc), "ServiceUnavailableError")
    return runs


def _check_budget(state: ServerState, gi: GenerateInput) -> None:
    lim = state.cluster.limits
    budget.check(state.request_budget, prompt_lens=[len(p.ids) for p in gi.prompts], samples=gi.sampling.n,
                 returned=gi.n, max_tokens=gi.sampling.max_tokens, logprobs=gi.logprobs,
                 prompt_logprobs=gi.prompt_logprobs, echo=gi.echo, max_inflight=state.cluster.spec.max_inflight,
                 decode_kv_tokens=lim.get("decode_kv_tokens", lim["kv_tokens"]),
                 instance_kv_tokens=lim["kv_tokens"])


def _prompt_text(state: ServerState, prompt: PromptInput) -> str:
    if prompt.text is not None:
        return prompt.text
    return state.tokenizer.decode(prompt.ids) if state.tokenizer is not None else ""


def _head(state: ServerState, gi: GenerateInput, chunk: bool) -> dict[str, Any]:
    chat = gi.kind == "chat"
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": state.model_name}


async def _complete(state: ServerState, request: Request, gi: GenerateInput, runs: list[_Run]) -> Response:
    """The whole answer once every run has finished; 499 (everything aborted) if the client left first."""
    async def collect(run: _Run) -> None:
        while not run.done:
            toks, lp = await run.next_event()
            run.toks += toks
            if lp:
                run.lps += lp

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(collect(r) for r in runs)))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():          # the client went away: cancel everywhere, free the KV
            work.cancel()
            for run in runs:
                if not run.done:
                    state.cluster.abort(run.track.rid)
                    state.metrics.aborted.inc()
    if not work.done() or work.cancelled():
        return Response(status_code=499)
    failed = next((r for r in runs if r.error is not None), None)
    if failed is not None:
        return error_response(failed.error_status, failed.error,
                              _ERROR_TYPES.get(failed.error_status, "InternalServerError"))
    def render() -> bytes:              # off the event loop: echo and logprobs make this large
        chosen = _best(gi, runs)
        choices = [_choice(state, gi, run, index) for index, run in enumerate(chosen)]
        body = {**_head(state, gi, False), "choices": choices, "usage": _usage(gi, chosen)}
        if gi.kind == "chat" and gi.prompt_logprobs is not None:     # vLLM: one prompt, beside the choices
            body["prompt_logprobs"] = chosen[0].vllm_prompt_logprobs()
        return encode_json(body)        # in pieces: the event loop is never held for long

    content = await asyncio.get_running_loop().run_in_executor(state.render_pool, render)
    return Response(content, media_type="application/json")


def _choice(state: ServerState, gi: GenerateInput, run: _Run, index: int) -> dict[str, Any]:
    """One choice of a complete (not streamed) answer."""
    text = run.detok.delta(final=True)
    head = _prompt_text(state, run.prompt) if gi.echo else ""
    lpb = run.logprobs_block(run.toks, run.lps or None, len(head))
    choice: dict[str, Any] = {"index": index, "logprobs": run.echo_logprobs(lpb) if gi.echo else lpb,
                              "finish_reason": run.finish,
                              "stop_reason": stop_reason(run.detok, run.finish, gi.sampling.stop_token_ids)}
    if gi.kind == "chat":
        choice["message"] = {"role": "assistant", "content": gi.chat_echo + text}
        spec = gi.sampling.structured
        if spec is not None and spec.kind in ("tool", "tools_required"):
            calls = _forced_calls(spec, text, run.finish)
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                if run.finish == "stop":
                    choice["finish_reason"] = tool_finish_reason(spec)
        elif gi.tool_parser is not None:      # auto tool choice: the model's own tool-call text
            parsed = get_parser(gi.tool_parser).extract(text, gi.tool_names)
            if parsed.calls:
                choice["message"] = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                choice["finish_reason"] = "tool_calls"
    else:
        choice["text"] = head + text
        if gi.prompt_logprobs is not None:
            choice["prompt_logprobs"] = run.vllm_prompt_logprobs()
    if gi.return_token_ids:
        choice["token_ids"] = run.toks
        choice["prompt_token_ids"] = run.prompt.ids
    return choice


def _forced_calls(spec, text: str, finish: str | None) -> list[dict[str, Any]] | None:
    """The ``tool_calls`` of a choice whose output a named or ``"required"`` tool choice
    constrained. As vLLM: a complete output is its calls; one cut short (``max_tokens``) is, for a
    named function, that call with the partial arguments text, and for ``"required"`` no call
    (``[]``); either way the message's content is null."""
    if finish == "stop":
        try:
            return openai_tool_calls(spec, text)
        except ValueError:          # not a complete call (cannot happen under the constraint)
            return None
    if spec.kind == "tool":
        return [{"id": call_id(), "type": "function",
                 "function": {"name": json.loads(spec.value)["name"], "arguments": text}}]
    return []


class _StreamChunks:
    """The SSE chunks of one streamed answer: the opening chunk of each choice, then one chunk per
    batch of tokens (text or chat delta, tool-call deltas, logprobs; the echoed prompt and its
    prompt logprobs ride on a choice's first tokens)."""

    def __init__(self, state: ServerState, gi: GenerateInput, runs: list[_Run]) -> None:
        self.state, self.gi, self.runs = state, gi, runs
        self.chat = chat = gi.kind == "chat"
        self.head = _head(state, gi, True)
        self.spec = spec = gi.sampling.structured
        self.tool = chat and spec is not None and spec.kind in ("tool", "tools_required")
        self.streams = {run.index: ToolCallStream(spec) if self.tool else None for run in runs}
        self.autos = ({run.index: AutoToolStream(get_parser(gi.tool_parser), gi.tool_names) for run in runs}
                      if chat and gi.tool_parser else {})
        self.offsets = dict.fromkeys(self.streams, 0)
        # echo with logprobs: the prompt (and its logprobs) goes with each choice's first tokens
        self.echo_due = ({run.index for run in runs} if gi.echo and gi.logprobs is not None and not chat
                         else set())
        self.plp_due = {run.index for run in runs} if gi.prompt_logprobs is not None and not chat else set()

    def opening(self, run: _Run) -> str | None:
        """The first chunk of a choice: the assistant role (chat), the echoed prompt (completions
        with echo and no logprobs), else none."""
        gi = self.gi
        if self.chat:
            return _sse({**self.head, "choices": [{"index": run.index,
                                                   "delta": {"role": "assistant", "content": gi.chat_echo},
                                                   "logprobs": None, "finish_reason": None}]})
        if gi.echo and gi.logprobs is None:
            text = _prompt_text(self.state, run.prompt)
            self.offsets[run.index] = len(text)
            return _sse({**self.head, "choices": [{"index": run.index, "text": text, "logprobs": None,
                                                   "finish_reason": None}]})
        return None

    def heavy(self, run: _Run, toks: list[int]) -> bool:
        """Whether rendering this chunk is worth a worker thread."""
        gi = self.gi
        return (run.index in self.echo_due or run.index in self.plp_due
                or len(toks) * (1 + (gi.logprobs or 0)) > _HEAVY_CHUNK_ENTRIES)

    def chunk(self, run: _Run, toks: list[int], lp: list | None) -> str:
        gi = self.gi
        big = self.heavy(run, toks)
        text = run.detok.delta(final=run.finish is not None)
        if run.index in self.echo_due:
            self.echo_due.discard(run.index)
            prompt_text = _prompt_text(self.state, run.prompt)
            lpb = run.echo_logprobs(run.logprobs_block(toks, lp, len(prompt_text)))
            text = prompt_text + text
            self.offsets[run.index] = 0
        else:
            lpb = run.logprobs_block(toks, lp, self.offsets[run.index])
        self.offsets[run.index] += len(text)
        choice: dict[str, Any] = {"index": run.index, "logprobs": lpb, "finish_reason": run.finish,
                                  "stop_reason": stop_reason(run.detok, run.finish, gi.sampling.stop_token_ids)}
        if self.tool:
            choice["delta"] = self.streams[run.index].delta(text)
            if run.finish == "stop":
                choice["finish_reason"] = tool_finish_reason(self.spec)
        elif self.autos:
            choice["delta"] = self.autos[run.index].delta(text, run.finish is not None)
            if self.autos[run.index].called:
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["delta"] = {"content": text} if text or run.finish is None else {}
        else:
            choice["text"] = text
            if run.index in self.plp_due and run.prompt_lps is not None:
                self.plp_due.discard(run.index)
                choice["prompt_logprobs"] = run.vllm_prompt_logprobs()
        if gi.return_token_ids:
            choice["token_ids"] = toks
        chunk = {**self.head, "choices": [choice]}
        if gi.continuous_usage:
            chunk["usage"] = _usage(gi, self.runs)
        return _sse(chunk, big)


async def _stream(state: ServerState, gi: GenerateInput, runs: list[_Run]):
    chunks = _StreamChunks(state, gi, runs)
    done = False
    try:
        for run in runs:
            first = chunks.opening(run)
            if first is not None:
                yield first
        loop = asyncio.get_running_loop()
        async for run, toks, lp in _merged_events(runs):
            if run.error is not None:
                yield _sse({"error": {"message": run.error, "code": run.error_status,
                                      "type": _ERROR_TYPES.get(run.error_status, "InternalServerError")}})
                break
            yield (await loop.run_in_executor(state.render_pool, chunks.chunk, run, toks, lp)
                   if chunks.heavy(run, toks) else chunks.chunk(run, toks, lp))
        else:
            if gi.include_usage:
                yield _sse({**chunks.head, "choices": [], "usage": _usage(gi, runs)})
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:                 # client disconnected (or the server is stopping)
            for run in runs:
                state.cluster.abort(run.track.rid)
                if not run.done:
                    state.metrics.aborted.inc()
