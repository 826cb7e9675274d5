"""vLLM's utility endpoints beside the OpenAI API, in vLLM's request and response shapes:

``POST /tokenize``
    ``{"prompt": "...", "add_special_tokens": true}`` or ``{"messages": [...], "tools": [...],
    "add_generation_prompt": true, "chat_template_kwargs": {...}}`` (the served chat template,
    tools included, as a chat request renders them), optional ``model`` and
    ``return_token_strs`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``.
``POST /detokenize``
    ``{"tokens": [...]}`` -> ``{"prompt": "..."}``.
``GET /version``
    ``{"version": "<laneserve's version>"}``.
``/v1/responses``
    not implemented: a 404 in OpenAI's error shape that says so (rather than FastAPI's bare
    "Not Found"), pointing at ``/v1/chat/completions``.

Bodies are parsed and checked as the generation endpoints' are (400s naming the field); the
tokenizer runs in the parse pool, off the event loop.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from laneserve.server.protocol import BadRequest, _show, chat_prompt, parse_body, text_limit

MAX_DETOKENIZE_IDS = 1 << 20


def _error(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("laneserve")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return "0.0.0+source"


def _model_ok(body: dict, state) -> None:
    model = body.get("model")
    if model is not None and model not in (state.model_name, state.model_path, *state.defaults.served_names):
        raise LookupError(f"The model `{_show(model)}` does not exist. Served: `{state.model_name}`.")


def tokenize(raw: bytes, state, max_model_len: int) -> dict[str, Any]:
    tok = state.tokenizer
    body = parse_body(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model_ok(body, state)
    if tok is None:
        raise BadRequest("this model has no tokenizer")
    special = body.get("add_special_tokens")
    if "messages" in body:
        text = chat_prompt({**body, "model": body.get("model")}, tokenizer=tok, defaults=state.defaults,
                           max_model_len=max_model_len)
        ids = list(tok.encode(text, add_special_tokens=bool(special)))       # the template wrote them
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string (or send 'messages')", "prompt")
        if special is not None and not isinstance(special, bool):
            raise BadRequest("'add_special_tokens' must be a boolean", "add_special_tokens")
        text_limit(len(prompt), max_model_len, "prompt")        # before the tokenizer: the prompt's budget
        ids = list(tok.encode(prompt, add_special_tokens=special is not False))
    strs = tok.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(raw: bytes, state, max_model_len: int) -> dict[str, Any]:
    body = parse_body(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model_ok(body, state)
    ids = body.get("tokens")
    if isinstance(ids, list) and len(ids) > max_model_len:
        raise BadRequest(f"'tokens' holds {len(ids)} ids, more than this model's context of {max_model_len}",
                         "tokens")
    if (not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    if state.tokenizer is None:
        raise BadRequest("this model has no tokenizer")
    vocab = state.cluster.limits["vocab_size"]
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {_show(bad)} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": state.tokenizer.decode(ids)}


def install_extras(app: FastAPI, state) -> None:
    """Register ``/tokenize``, ``/detokenize``, ``/version`` and the ``/v1/responses`` 404."""

    async def _run(fn, *args) -> Response:
        try:
            out = await asyncio.get_running_loop().run_in_executor(state.parse_pool, partial(fn, *args))
        except BadRequest as exc:
            return _error(400, str(exc), "BadRequestError", exc.param)
        except LookupError as exc:
            return _error(404, str(exc), "NotFoundError", "model")
        return JSONResponse(out)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await _run(tokenize, await request.body(), state, _max_model_len(state))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await _run(detokenize, await request.body(), state, _max_model_len(state))

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version_route() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.api_route("/v1/responses", methods=["GET", "POST"])
    async def responses_route() -> JSONResponse:
        return _error(404, "/v1/responses (OpenAI's Responses API) is not supported by laneserve; use "
                           "/v1/chat/completions or /v1/completions", "NotFoundError")


def _max_model_len(state) -> int:
    limit = state.cluster.limits["max_model_len"]
    return min(limit, state.defaults.max_model_len or limit)
