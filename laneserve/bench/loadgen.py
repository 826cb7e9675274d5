"""An asyncio load generator for any OpenAI-compatible server (the counterpart of ``vllm bench serve``).

A workload (named or a trace) is replayed against ``/v1/completions``: request *i* is sent at its
arrival offset (the workload's own arrival pattern rescaled to the requested rate, or all at once
for an infinite rate), optionally under a concurrency cap. Prompts are synthesised token ids of the
trace's prompt lengths (deterministic by seed; the completions endpoint accepts token-id prompts,
as vLLM's does) with ``max_tokens`` = the trace's output length and ``ignore_eos`` (vLLM's
extension), so the server does exactly the work the trace describes. ``LoadConfig.prompts`` gives
requests their own prompts instead (text or token ids: the ``vllm bench serve`` datasets of
:mod:`laneserve.workloads.bench_datasets`); a chat endpoint gets each prompt as one user message
(token-id prompts become filler words of about their length). Responses are streamed and
every chunk's arrival time is recorded: TTFT = first token chunk - send time, ITL = gaps between
chunks, output tokens from the usage chunk (``stream_options.include_usage``).

With laneserve extensions on (default), each request also carries its SLO (``slo: {ttft_ms,
tpot_ms}``, ``slo_class``) so SLO-aware policies see it, and asks for ``return_token_ids`` so a
model without a tokenizer still shows its tokens; turn them off for other servers.

Prompts longer than the server allows are cut to fit before sending by :func:`clamp_to_context`
(``laneserve bench`` does this with the server's ``max_model_len`` and warns). Failed requests keep
their error; :func:`error_counts` groups them by reason.

Results become :class:`~laneserve.core.request.Request` objects with their timestamps, so
:func:`laneserve.measure.metrics.summarize` computes vLLM's metric keys plus SLO attainment exactly
as for a simulated run — which is what makes the side-by-side with the simulator meaningful.

Multi-turn chat sessions (closed loop, each turn after the previous reply) are
:mod:`laneserve.bench.sessions`; both modes stream through :func:`stream_request`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from laneserve.core.request import Phase, Request, RequestSpec


@dataclass(slots=True)
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None                # None: the first id of /v1/models
    max_concurrency: int | None = None
    laneserve_extensions: bool = True       # send slo / slo_class / return_token_ids
    vocab_size: int | None = None           # None: /v1/models' vocab_size, else 1000
    seed: int = 0
    timeout: float = 600.0
    progress: bool | None = None
    temperature: float | None = 0.0         # None: leave it to the server
    ignore_eos: bool = True                 # vLLM's extension: generate exactly max_tokens
    sampling: dict[str, Any] = field(default_factory=dict)   # more request fields (top_p, top_k ...)
    prompts: dict[int, str | tuple[int, ...]] | None = None  # request_id -> prompt (else synthesised)


@dataclass(slots=True)
class RequestOutcome:
    spec: RequestSpec
    success: bool = False
    send: float = 0.0                       # seconds from the run start
    first: float | None = None
    chunks: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    error: str = ""
    status: int | None = None
    text: str = ""                          # the reply as streamed
    prompt_tokens: int | None = None        # usage.prompt_tokens, when the server sent usage
    cached_tokens: int = 0                  # usage.prompt_tokens_details.cached_tokens (0 if absent)


@dataclass(slots=True)
class LoadResult:
    outcomes: list[RequestOutcome]
    duration: float
    model: str


def synth_prompt(spec: RequestSpec, vocab_size: int, seed: int) -> list[int]:
    """Deterministic token ids of the spec's prompt length (the spec's own ids when it has them)."""
    if spec.prompt_token_ids:
        return [int(t) % vocab_size for t in spec.prompt_token_ids]
    rng = random.Random(seed * 1_000_003 + spec.request_id)
    lo, hi = min(10, vocab_size - 2), max(11, vocab_size - 2)
    return [rng.randrange(lo, hi) for _ in range(spec.prompt_len)]


_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
          "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
          "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more")


def filler_text(n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of common words (a chat prompt for a spec without text)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_tokens)))


async def _model_info(client, cfg: LoadConfig) -> tuple[str, int | None, int | None]:
    """(id, vocab_size, max_model_len) of the server's first model (None where not reported)."""
    resp = await client.get(cfg.base_url.rstrip("/") + "/v1/models")
    data = resp.json()
    first = data["data"][0]
    return first["id"], first.get("vocab_size"), first.get("max_model_len")


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


async def _one(client, cfg: LoadConfig, url: str, model: str, vocab: int, spec: RequestSpec, t0: float,
               out: RequestOutcome) -> None:
    prompt = cfg.prompts.get(spec.request_id) if cfg.prompts else None
    if prompt is None:
        prompt = synth_prompt(spec, vocab, cfg.seed)
    payload: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, **cfg.sampling}
    if is_chat(cfg.endpoint):
        text = prompt if isinstance(prompt, str) else filler_text(len(prompt), cfg.seed * 1_000_003 + spec.request_id)
        payload["messages"] = [{"role": "user", "content": text}]
    else:
        payload["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.laneserve_extensions:
        slo = {k: v * 1e3 for k, v in (("ttft_ms", spec.slo.ttft), ("tpot_ms", spec.slo.tpot)) if v is not None}
        if slo:
            payload["slo"] = slo
        payload["slo_class"] = spec.slo_class
    await stream_request(client, cfg, url, payload, t0, out)


async def stream_request(client, cfg: LoadConfig, url: str, payload: dict[str, Any], t0: float,
                         out: RequestOutcome) -> None:
    """POST ``payload`` (a completions or chat request) streamed, recording into ``out``: chunk
    times, the reply text (``text`` or ``delta.content``), and the usage chunk's token counts
    (``prompt_tokens_details.cached_tokens`` when the server reports it)."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.temperature is not None:
        payload["temperature"] = cfg.temperature
    if cfg.laneserve_extensions:
        payload["return_token_ids"] = True
    out.send = time.perf_counter() - t0
    usage_tokens = None
    counted = 0
    text: list[str] = []
    try:
        async with asyncio.timeout(cfg.timeout), client.stream("POST", url, json=payload) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for raw in resp.aiter_lines():
                line = raw.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message", obj["error"]))
                    return
                if usage := obj.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for ch in obj.get("choices") or ():
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    text.append(piece)
                    n = len(ch.get("token_ids") or ()) or (1 if piece else 0)
                    if n:
                        counted += n
                        out.chunks.append(now)
                        if out.first is None:
                            out.first = now
        out.end = time.perf_counter() - t0
        out.text = "".join(text)
        out.output_tokens = usage_tokens if usage_tokens is not None else counted
        out.success = out.first is not None
        if not out.success:
            out.error = "no tokens received"
    except Exception as exc:  # noqa: BLE001 - timeouts, httpx.HTTPError, bad JSON: a failed request
        out.error = f"{type(exc).__name__}: {exc}"


async def run_load(cfg: LoadConfig, specs: Sequence[RequestSpec], *, rate: float | None = None) -> LoadResult:
    """Send ``specs`` at their arrival offsets (all at t=0 when ``rate`` is ``inf``)."""
    import httpx

    from laneserve.measure.progress import progress_bar
    # no connection cap (the concurrency cap is cfg.max_concurrency); cfg.timeout bounds each request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits) as client:
        model, vocab = (cfg.model, cfg.vocab_size)
        if model is None or vocab is None:
            m, v, _ = await _model_info(client, cfg)
            model = model or m
            vocab = vocab or v or 1000
        url = cfg.base_url.rstrip("/") + cfg.endpoint
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        outcomes = [RequestOutcome(s) for s in specs]
        bar = progress_bar(total=len(specs), desc="requests", enabled=cfg.progress)
        base = specs[0].arrival_time if specs else 0.0
        t0 = time.perf_counter()

        async def fire(spec: RequestSpec, out: RequestOutcome) -> None:
            at = 0.0 if rate is not None and math.isinf(rate) else spec.arrival_time - base
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    await _one(client, cfg, url, model, vocab, spec, t0, out)
            else:
                await _one(client, cfg, url, model, vocab, spec, t0, out)
            bar.update(1)

        await asyncio.gather(*(fire(s, o) for s, o in zip(specs, outcomes)))
        duration = time.perf_counter() - t0
        bar.close()
    return LoadResult(outcomes, duration, model)


def to_requests(result: LoadResult) -> list[Request]:
    """The outcomes as core requests with timestamps (arrival = send time) and the server's prompt
    token count where it reported one, for ``summarize``."""
    reqs = []
    for o in result.outcomes:
        s = o.spec
        r = Request(request_id=s.request_id, arrival_time=o.send, prompt_len=o.prompt_tokens or s.prompt_len,
                    max_output_tokens=s.output_len, slo=s.slo, slo_class=s.slo_class, priority=s.priority,
                    session_id=s.session_id, turn=s.turn, num_cached_tokens=o.cached_tokens)
        t = r.times
        if o.success:
            t.first_token = o.first
            t.last_token = o.chunks[-1] if o.chunks else o.first
            t.finished = o.end
            t.token_times = list(o.chunks)
            if len(o.chunks) >= 2:
                t.max_itl = max(b - a for a, b in zip(o.chunks, o.chunks[1:]))
            r.num_output_tokens = o.output_tokens
            r.phase = Phase.FINISHED
            r.finish_reason = "length"
        else:
            r.phase = Phase.ABORTED
            r.finish_reason = "error"
            t.finished = o.end
        reqs.append(r)
    return reqs


def bench_summary(result: LoadResult, *, percentiles: Sequence[float] = (90, 99)) -> dict[str, Any]:
    """``vllm bench serve``'s result keys (metrics + per-request lists) plus SLO attainment and the
    failures counted by reason (``error_counts``)."""
    from laneserve.measure.metrics import summarize
    reqs = to_requests(result)
    s = summarize(reqs, duration=result.duration, percentiles=percentiles)
    outs = result.outcomes
    s.update({"model_id": result.model, "num_prompts": len(outs),
              "input_lens": [o.prompt_tokens or o.spec.prompt_len for o in outs],
              "cached_tokens": [o.cached_tokens for o in outs],
              "output_lens": [o.output_tokens for o in outs],
              "ttfts": [(o.first - o.send) if o.first is not None else None for o in outs],
              "itls": [[b - a for a, b in zip(o.chunks, o.chunks[1:])] for o in outs],
              "latencies": [(o.end - o.send) if o.success and o.end is not None else None for o in outs],
              "start_times": [o.send for o in outs],
              "generated_texts": [o.text for o in outs],
              "errors": [o.error for o in outs],
              "error_counts": error_counts(outs),
              "rejected_429": sum(1 for o in outs if o.status == 429)})
    s.update(peak_output(outs))
    return s


def clamp_to_context(specs: Sequence[RequestSpec], prompts: dict[int, str | tuple[int, ...]] | None, limit: int, *,
                     truncate_text: Callable[[str, int], str] | None = None, text_margin: int = 0
                     ) -> tuple[list[RequestSpec], dict[int, str | tuple[int, ...]] | None, int]:
    """Cut each request so that prompt + output tokens fit ``limit`` (a server's ``max_model_len``):
    the output keeps its length up to ``limit - 1`` tokens and the prompt is cut to the room left
    (token ids dropped from the end; text through ``truncate_text(text, n_tokens)`` with
    ``text_margin`` tokens kept free for tokenizer and chat-template differences). Returns the new
    specs, the new prompts and how many requests were cut."""
    if limit < 2:
        raise ValueError(f"context limit {limit} leaves no room for a prompt and an output token")
    new_specs, new_prompts, cut = [], dict(prompts) if prompts is not None else None, 0
    for spec in specs:
        prompt = prompts.get(spec.request_id) if prompts else None
        margin = text_margin if isinstance(prompt, str) else 0
        out = min(spec.output_len, limit - 1)
        room = max(1, limit - out - margin)
        if spec.prompt_len <= room and out == spec.output_len:
            new_specs.append(spec)
            continue
        cut += 1
        p_len = min(spec.prompt_len, room)
        ids = spec.prompt_token_ids[:p_len] if spec.prompt_token_ids else None
        new_specs.append(replace(spec, prompt_len=p_len, output_len=out, prompt_token_ids=ids,
                                 prefix_len=min(spec.prefix_len, p_len)))
        if prompt is not None and spec.prompt_len > p_len:
            if isinstance(prompt, str):
                if truncate_text is None:
                    raise ValueError("text prompts need truncate_text to be cut")
                new_prompts[spec.request_id] = truncate_text(prompt, p_len)
            else:
                new_prompts[spec.request_id] = tuple(prompt[:p_len])
    return new_specs, new_prompts, cut


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def error_reason(out: RequestOutcome) -> str:
    """A failure's reason, with the numbers in it replaced by N so that the same failure of many
    requests (the same limit exceeded by different prompts) counts as one reason."""
    head, text = "", out.error
    if text.startswith("HTTP "):
        head, _, body = text.partition(": ")
        head += ": "
        try:
            err = json.loads(body)
            msg = err.get("error", err) if isinstance(err, dict) else err
            text = str(msg.get("message", msg) if isinstance(msg, dict) else msg)
        except ValueError:
            text = body
    return (head + _NUMBER.sub("N", text.strip()))[:200] or "unknown error"


def error_counts(outcomes: Sequence[RequestOutcome]) -> dict[str, int]:
    """Failed requests by reason (most frequent first)."""
    return dict(Counter(error_reason(o) for o in outcomes if not o.success).most_common())


def peak_output(outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    """vLLM's peak figures: the most output tokens delivered in one wall-clock second of the run
    (each streamed chunk carrying its request's tokens evenly) and the most requests in flight
    during that second."""
    per_second: dict[int, float] = {}
    for o in outcomes:
        if o.success and o.chunks:
            share = o.output_tokens / len(o.chunks)
            for t in o.chunks:
                per_second[int(t)] = per_second.get(int(t), 0.0) + share
    if not per_second:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    sec, peak = max(per_second.items(), key=lambda kv: kv[1])
    active = sum(1 for o in outcomes if o.send < sec + 1 and (o.end if o.end is not None else o.send) >= sec)
    return {"max_output_tokens_per_s": float(peak), "max_concurrent_requests": active}
