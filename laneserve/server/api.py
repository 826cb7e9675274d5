"""The OpenAI-compatible HTTP API (issue 6, item 2): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/debug/state`` (per-instance KV blocks,
queues and liveness, for tests and operators).

Requests are validated by :mod:`laneserve.server.protocol` (400 with a clear message), admitted by
the router (:class:`~laneserve.cluster.process.ProcessCluster`: 429 + ``Retry-After`` when
overloaded, 503 when no instance can serve) and answered from the per-request event queue, either
as one JSON body or as server-sent events ending in ``data: [DONE]`` (with a usage chunk when
``stream_options.include_usage`` is set). A client that disconnects — streaming or not — cancels
its request on the instance that holds it, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from laneserve.cluster.process import Overloaded, ProcessCluster, Track, Unavailable
from laneserve.server.detok import IncrementalDetokenizer, token_text
from laneserve.server.metrics import ServerMetrics
from laneserve.server.protocol import BadRequest, GenerateInput, ServerDefaults, parse_chat, parse_completion


@dataclass(slots=True)
class ServerState:
    cluster: ProcessCluster
    model_name: str
    model_path: str
    tokenizer: Any
    defaults: ServerDefaults
    metrics: ServerMetrics


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Run:
    """One request's output as it arrives: text, tokens, logprobs, metrics observations."""

    def __init__(self, state: ServerState, gi: GenerateInput, track: Track) -> None:
        self.state, self.gi, self.track = state, gi, track
        self.detok = IncrementalDetokenizer(state.tokenizer, gi.sampling.stop, gi.skip_special_tokens)
        self.finish: str | None = None
        self.error: str | None = None
        self.n_tokens = 0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.queue_time: float | None = None

    async def next_event(self) -> tuple[list[int], list | None]:
        """The next tokens (and their logprobs); sets ``finish``/``error`` when the request ends."""
        ev = await self.track.events.get()
        if ev[0] == "err":
            self.error = ev[1]
            return [], None
        _, toks, finish, lp, info = ev
        now = self.state.cluster.clock.now()
        m = self.state.metrics
        if toks:
            if self.t_first is None:
                self.t_first = now
                m.ttft.observe(now - self.track.request.arrival_time, model_name=m.model)
            else:
                m.itl.observe(now - self.t_last, model_name=m.model)
            self.t_last = now
        if info and info.get("prefill_start") is not None and self.queue_time is None:
            self.queue_time = max(0.0, info["prefill_start"] - self.track.request.arrival_time)
            m.queue.observe(self.queue_time, model_name=m.model)
        self.detok.add(toks)
        if self.detok.stopped and finish is None:
            finish = "stop"
            self.state.cluster.abort(self.track.rid)
        n_before = self.n_tokens
        self.n_tokens = len(self.detok.ids)
        if lp is not None:
            lp = lp[: self.n_tokens - n_before]
        self.finish = finish
        if finish is not None:
            self._on_finish(now)
        return toks[: self.n_tokens - n_before], lp

    def _on_finish(self, now: float) -> None:
        m, req = self.state.metrics, self.track.request
        e2e = now - req.arrival_time
        m.e2e.observe(e2e, model_name=m.model)
        m.success.inc(model_name=m.model, finished_reason=self.finish)
        m.generation_tokens.inc(self.n_tokens, model_name=m.model)
        ttft = (self.t_first or now) - req.arrival_time
        tpot = (e2e - ttft) / (self.n_tokens - 1) if self.n_tokens > 1 else None
        if tpot is not None:
            m.tpot.observe(tpot, model_name=m.model)
        if req.slo.ttft is not None or req.slo.tpot is not None:
            ok_ttft = req.slo.ttft is None or ttft <= req.slo.ttft
            ok_tpot = req.slo.tpot is None or tpot is None or tpot <= req.slo.tpot
            m.slo_total.inc(model_name=m.model, slo_class=req.slo_class)
            for name, ok in (("ttft", ok_ttft), ("tpot", ok_tpot), ("both", ok_ttft and ok_tpot)):
                if ok:
                    m.slo_met.inc(model_name=m.model, slo_class=req.slo_class, target=name)

    def usage(self) -> dict[str, int]:
        p = len(self.gi.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": self.n_tokens, "total_tokens": p + self.n_tokens}

    def logprobs_block(self, toks: list[int], lp: list | None, offset: int) -> Any:
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


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="laneserve", lifespan=lifespan)
    app.state.ls = state

    async def _body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON in the request body: {exc}") from None

    async def _generate(request: Request, kind: str) -> Response:
        st = state
        try:
            body = await _body(request)
            limits = st.cluster.limits
            headers = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-slo-")}
            parse = parse_completion if kind == "completion" else parse_chat
            gi = parse(body, tokenizer=st.tokenizer, max_model_len=limits["max_model_len"],
                       vocab_size=limits["vocab_size"], kv_tokens=limits["kv_tokens"], headers=headers,
                       defaults=st.defaults)
        except BadRequest as exc:
            st.metrics.rejected.inc(model_name=st.metrics.model, reason="bad_request")
            return error_response(400, str(exc), "BadRequestError", exc.param)
        if gi.model not in (st.model_name, st.model_path):
            return error_response(404, f"The model `{gi.model}` does not exist. Served: `{st.model_name}`.",
                                  "NotFoundError", "model")
        try:
            track = st.cluster.submit(gi.prompt_ids, gi.sampling, slo=gi.slo, slo_class=gi.slo_class,
                                      priority=gi.priority)
        except Overloaded as exc:
            st.metrics.rejected.inc(model_name=st.metrics.model, reason="overloaded")
            return error_response(429, str(exc), "RateLimitError", headers={"Retry-After": str(exc.retry_after)})
        except Unavailable as exc:
            st.metrics.rejected.inc(model_name=st.metrics.model, reason="unavailable")
            return error_response(503, str(exc), "ServiceUnavailableError")
        st.metrics.prompt_tokens.inc(len(gi.prompt_ids), model_name=st.metrics.model)
        run = _Run(st, gi, track)
        if gi.stream:
            return StreamingResponse(_stream(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _complete(request, run)

    async def _complete(request: Request, run: _Run) -> Response:
        async def collect() -> tuple[list[int], list]:
            toks_all, lps = [], []
            while run.finish is None and run.error is None:
                toks, lp = await run.next_event()
                toks_all += toks
                if lp:
                    lps += lp
            return toks_all, lps

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():          # the client went away: cancel everywhere, free the KV
                work.cancel()
                state.cluster.abort(run.track.rid)
        if not work.done() or work.cancelled():
            return Response(status_code=499)
        toks, lps = work.result()
        if run.error is not None:
            return error_response(500, run.error, "InternalServerError")
        text = run.detok.delta(final=True)
        gi = run.gi
        rid = run.track.rid
        created = int(time.time())
        choice: dict[str, Any] = {"index": 0, "logprobs": run.logprobs_block(toks, lps or None, 0),
                                  "finish_reason": run.finish, "stop_reason": None}
        if gi.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                   "model": state.model_name, "choices": [choice], "usage": run.usage()}
        else:
            choice["text"] = text
            obj = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                   "model": state.model_name, "choices": [choice], "usage": run.usage()}
        if gi.return_token_ids:
            choice["token_ids"] = toks
            choice["prompt_token_ids"] = gi.prompt_ids
        return JSONResponse(obj)

    async def _stream(run: _Run):
        gi = run.gi
        chat = gi.kind == "chat"
        rid = run.track.rid
        created = int(time.time())
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": state.model_name}
        done = False
        offset = 0
        try:
            if chat:
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            while run.finish is None:
                toks, lp = await run.next_event()
                if run.error is not None:
                    yield _sse({"error": {"message": run.error, "type": "InternalServerError", "code": 500}})
                    break
                text = run.detok.delta(final=run.finish is not None)
                lpb = run.logprobs_block(toks, lp, offset)
                offset += len(text)
                choice: dict[str, Any] = {"index": 0, "logprobs": lpb, "finish_reason": run.finish}
                if chat:
                    choice["delta"] = {"content": text} if text or run.finish is None else {}
                else:
                    choice["text"] = text
                if gi.return_token_ids:
                    choice["token_ids"] = toks
                chunk = {**head, "choices": [choice]}
                if gi.continuous_usage:
                    chunk["usage"] = run.usage()
                yield _sse(chunk)
            if gi.include_usage and run.error is None:
                yield _sse({**head, "choices": [], "usage": run.usage()})
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:                 # client disconnected (or the server is stopping)
                state.cluster.abort(rid)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        lim = state.cluster.limits
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "laneserve",
            "root": state.model_path, "max_model_len": lim["max_model_len"], "vocab_size": lim["vocab_size"]}]})

    @app.get("/health")
    async def health() -> Response:
        c = state.cluster
        try:
            c.admission(0)
        except Unavailable as exc:
            return error_response(503, str(exc), "ServiceUnavailableError")
        except Overloaded:
            pass
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        c = state.cluster
        insts = []
        for h in c.instances:
            s = h.stats
            insts.append({"id": h.instance_id, "role": h.role, "running": s.get("running"),
                          "waiting": s.get("waiting"), "kv_usage": s.get("kv_usage"), "kv_free": s.get("kv_free"),
                          "kv_total": s.get("kv_total"), "preemptions": s.get("preemptions"),
                          "alive": 1 if h.alive else 0})
        return PlainTextResponse(state.metrics.render(insts, len(c.tracks)),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/state")
    async def debug_state() -> JSONResponse:
        return JSONResponse({"model": state.model_name, **state.cluster.state()})

    return app
