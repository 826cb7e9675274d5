"""Prefix caching on live multi-turn traffic: ``laneserve serve`` with 2 prefill + 1
decode instances (the embedded smoke model on CPU) replaying ShareGPT conversations as closed-loop
sessions (``laneserve bench --sessions``'s engine, :mod:`laneserve.bench.sessions`), under four
setups:

* ``round-robin``, prefix caching off (``--no-prefix-caching``): every turn recomputes its history;
* ``round-robin``, caching on: a later turn finds its history only when it lands where the
  previous turn ran (half the time with two instances);
* ``cache-aware``, caching on: the router routes by the instances' published block summaries;
* ``laps-pools``, caching on: LAPS' pools, with affinity by the same summaries.

For each: TTFT of first and later turns (mean, p90), and the prefix hit rate (cached / prompt
tokens, as the server reports ``usage.prompt_tokens_details.cached_tokens``). Beside each, the
simulator twin's prediction of the same: the turns exactly as they were sent (send offsets, the
server's prompt token counts) replayed in the simulator with the same cluster shape and router,
per-instance prefix caches as large as the instance's KV, on a cost model fitted to a profile of
the same smoke engine taken on this machine at the start of the run.

    PYTHONPATH=. flock /tmp/laneserve-bench.lock nice -n 5 .venv/bin/python benchmarks/prefix_live.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from laneserve.bench.live_server import Server
from laneserve.bench.loadgen import LoadConfig
from laneserve.bench.results import markdown_table, write_result
from laneserve.bench.sessions import (default_token_counter, load_conversations, observed_workload, plan_sessions,
                                      run_sessions, session_summary)

KV_TOKENS = 16384
SETUPS = (("round-robin", False), ("round-robin", True), ("cache-aware", True), ("laps-pools", True))


def profile_cost_model():
    """A fitted cost model of the smoke engine on this CPU (the twin's view of the hardware)."""
    import torch

    from laneserve.costmodel.fitted import FittedCostModel
    from laneserve.engine import EngineConfig
    from laneserve.engine.executor import EngineExecutor
    from laneserve.engine.profiler import FULL, EngineProfiler
    from laneserve.engine.smoke import smoke_model_path
    torch.set_num_threads(1)
    config = EngineConfig(num_threads=1, num_kv_blocks=KV_TOKENS // 16)
    grid = dict(FULL, prefill_lens=(16, 64, 256, 512, 1024, 2048), cached=(0, 256, 1024),
                decode_ctx=(32, 256, 1024, 2048), decode_batches=(1, 2, 4, 8, 16))
    ex = EngineExecutor.from_pretrained(str(smoke_model_path()), config)
    return FittedCostModel(EngineProfiler(ex, repeats=3).run(grid, model_name="smoke-llama", device="cpu"))


def simulate(specs, router: str, caching: bool, cost) -> dict:
    """The twin: first/later-turn TTFT and hit rate of the same turns in the simulator."""
    from dataclasses import replace

    from laneserve.sim import ClusterConfig, Simulator
    base = min(s.arrival_time for s in specs)
    specs = [replace(s, request_id=i, arrival_time=s.arrival_time - base) for i, s in enumerate(specs)]
    cfg = ClusterConfig(num_prefill=2, num_decode=1, router=router, prefill_kv_tokens=KV_TOKENS,
                        decode_kv_tokens=KV_TOKENS, kv_link="host", max_model_len=0,
                        prefill_opts={"prefix_caching": True} if caching else {},
                        prefix_cache_tokens=0 if caching else None)
    res = Simulator(cfg, cost).run(specs)
    reqs = [r for r in res.requests if r.times.first_token is not None]
    first = [r.times.first_token - r.arrival_time for r in reqs if r.turn == 0]
    later = [r.times.first_token - r.arrival_time for r in reqs if r.turn > 0]
    prompt = sum(r.prompt_len for r in reqs)
    cached = sum(r.num_cached_tokens for r in reqs)
    mean = lambda xs: 1e3 * sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"sim_first_ttft_ms": mean(first), "sim_later_ttft_ms": mean(later),
            "sim_hit_rate": cached / prompt if prompt else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0, help="session starts per second")
    ap.add_argument("--think-time", type=float, default=1.0)
    args = ap.parse_args()

    convs = load_conversations("sharegpt", args.sessions, max_turns=args.max_turns, max_tokens=32,
                               max_context=3072, count_tokens=default_token_counter("llama3"))
    plans = plan_sessions(convs, rate=args.rate, think_time=args.think_time, seed=0)
    print("profiling the smoke engine for the twin ...", file=sys.stderr)
    cost = profile_cost_model()
    rows = []
    for router, caching in SETUPS:
        flags = ["--prefill", "2", "--decode", "1", "--router-policy", router, "--kv-tokens", str(KV_TOKENS)]
        if not caching:
            flags.append("--no-prefix-caching")
        print(f"live: {router}, caching {'on' if caching else 'off'} ...", file=sys.stderr)
        server = Server(*flags)
        try:
            server.wait_ready()
            cfg = LoadConfig(base_url=server.url, endpoint="/v1/chat/completions", timeout=300, progress=False)
            result = asyncio.run(run_sessions(cfg, plans))
        finally:
            server.stop()
        s = session_summary(result)
        row = {"router": router, "prefix_caching": caching, "turns": s["turns_sent"],
               "failed": s["turns_sent"] - s["completed"],
               "first_ttft_ms": s["first_turn"]["mean_ttft_ms"], "first_p90_ms": s["first_turn"]["p90_ttft_ms"],
               "later_ttft_ms": s["later_turns"]["mean_ttft_ms"], "later_p90_ms": s["later_turns"]["p90_ttft_ms"],
               "hit_rate": s["prefix_cache_hit_rate"], "prompt_tokens": s["total_prompt_tokens"],
               "cached_tokens": s["total_cached_tokens"]}
        row.update(simulate(list(observed_workload(result).specs), router, caching, cost))
        rows.append(row)
        print({k: row[k] for k in ("router", "prefix_caching", "later_ttft_ms", "hit_rate", "sim_hit_rate")},
              file=sys.stderr)

    by = {(r["router"], r["prefix_caching"]): r for r in rows}
    off, rr = by[("round-robin", False)], by[("round-robin", True)]
    metrics = {
        "later_turn_ttft_ms_caching_off": off["later_ttft_ms"],
        "later_turn_ttft_ms_round_robin": rr["later_ttft_ms"],
        "later_turn_ttft_ms_cache_aware": by[("cache-aware", True)]["later_ttft_ms"],
        "later_turn_ttft_ms_laps_pools": by[("laps-pools", True)]["later_ttft_ms"],
        "hit_rate_round_robin": rr["hit_rate"],
        "hit_rate_cache_aware": by[("cache-aware", True)]["hit_rate"],
        "hit_rate_laps_pools": by[("laps-pools", True)]["hit_rate"],
        "sim_hit_rate_round_robin": rr["sim_hit_rate"],
        "sim_hit_rate_cache_aware": by[("cache-aware", True)]["sim_hit_rate"],
        "sim_hit_rate_laps_pools": by[("laps-pools", True)]["sim_hit_rate"],
        "turns_per_setup": rr["turns"],
    }
    md = (f"Live 2 prefill + 1 decode (smoke model, CPU), {args.sessions} ShareGPT sessions of at most "
          f"{args.max_turns} turns (replies <= 32 tokens), {args.rate:g} session starts/s, think time "
          f"{args.think_time:g} s (exponential). TTFT in ms; hit rate = cached / prompt tokens as the server "
          "reports them; sim_* = the simulator twin on the turns as sent.\n\n" + markdown_table(rows))
    write_result("prefix_live", metrics, markdown=md, extra={"rows": rows})
    print(md)


if __name__ == "__main__":
    main()
