"""Live serving benchmark: ``laneserve bench``'s load generator against a live 1P+1D
``laneserve serve`` deployment (small random-weight Qwen2-shaped model on CPU, one torch thread
per instance process), FCFS prefill + continuous-batching decode against the best prefill and
decode policies registered (S-EDF / LAPS prefill, Kairos / AlignedServe decode), at several
request rates. For every run the simulator replays the same requests at the same arrival offsets
with the same deployment and a fitted cost model of this engine (``laneserve profile``), so each
live attainment and goodput has the simulator's prediction beside it.

Workload: a short/long mix (85% short prompts of 16-128 tokens with a 0.3 s TTFT target, 15% long
prompts of 768-1536 tokens with 2 s; 16-48 output tokens, TPOT 0.1 s), Poisson arrivals; prompts
are synthesised token ids (the checkpoint has no tokenizer) with ``ignore_eos``. Goodput = the
highest swept rate whose both-SLO attainment reaches 90%.

    flock /tmp/laneserve-bench.lock .venv/bin/python benchmarks/serve_live.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from engine_models import random_checkpoint  # noqa: E402
from laneserve.bench.loadgen import LoadConfig, bench_summary, run_load  # noqa: E402
from laneserve.bench.report import best_x_meeting  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.commands.bench import simulate_run  # noqa: E402
from laneserve.core import SLO  # noqa: E402
from laneserve.costmodel import make_cost_model  # noqa: E402
from laneserve.policies import available  # noqa: E402
from laneserve.sim import ClusterConfig  # noqa: E402
from laneserve.workloads import make_workload  # noqa: E402

N, RATES, SEED, TARGET = 50, (0.5, 1.0, 2.0, 4.0), 0, 0.9
KV_TOKENS, HOST_KV_TOKENS = 65536, 4096 * 16     # host pool: 4096 blocks of 16 tokens
SLOS = {"short": SLO(0.3, 0.1), "long": SLO(2.0, 0.1)}
PROFILE = Path("out/serve_live/profile.json")


def policy_sets() -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """(prefill, decode, extra serve flags): the baseline, then the best registered ones."""
    pre, dec = set(available("prefill")), set(available("decode"))
    sets = [("fcfs", "continuous", [])]
    notes = []
    best_p = [p for p in ("sedf", "laps") if p in pre]
    best_d = [d for d in ("kairos", "alignedserve") if d in dec]
    if not best_p:
        notes.append("no paper prefill policy registered: fell back to cp-edf-2k")
        best_p = ["cp-edf-2k"]
    if not best_d:
        notes.append("no paper decode policy registered: fell back to continuous")
        best_d = ["continuous"]
    for p, d in zip(best_p, best_d):
        sets.append((p, d, ["--host-kv-tokens", str(HOST_KV_TOKENS)] if d == "alignedserve" else []))
    return sets, notes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, prefill: str, decode: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(f"out/serve_live/serve-{prefill}-{decode}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "laneserve.cli", "serve", "--model", str(model), "--port", str(port),
                             "--prefill", "1", "--decode", "1", "--prefill-policy", prefill, "--decode-policy", decode,
                             "--threads", "1", "--kv-tokens", str(KV_TOKENS), "--max-inflight", "1024", *extra],
                            stderr=log, stdout=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {prefill}+{decode} exited; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("server did not start")


def main() -> None:
    Path("out/serve_live").mkdir(parents=True, exist_ok=True)
    model = random_checkpoint("small")
    if not PROFILE.exists():
        print("profiling the engine (laneserve profile) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "laneserve.cli", "profile", "--model", str(model), "--threads", "1",
                        "--output", str(PROFILE)], check=True)
    cost = make_cost_model("fitted", profile=str(PROFILE))
    wl = make_workload("short_long_mix", n=N, long_share=0.15, short_len=(16, 128), long_len=(768, 1536),
                       output_len=(16, 48), seed=SEED, slo=SLOS)
    sets, notes = policy_sets()
    rows, goodputs = [], {}
    for prefill, decode, extra in sets:
        name = f"{prefill}+{decode}"
        try:
            proc, url = start_server(model, prefill, decode, extra)
        except (RuntimeError, TimeoutError) as exc:
            notes.append(f"{name}: could not start ({exc})")
            continue
        try:
            state = httpx.get(url + "/debug/state", timeout=5).json()
            config = ClusterConfig(prefill_policy=prefill, decode_policy=decode, prefill_kv_tokens=KV_TOKENS,
                                   decode_kv_tokens=KV_TOKENS, kv_link="host", host_kv_tokens=state["host_kv_tokens"],
                                   router=state["router"], decode_router=state["decode_router"])
            cfg = LoadConfig(base_url=url, progress=False, seed=SEED, timeout=300)
            asyncio.run(run_load(cfg, wl.with_rate(4.0).head(4).specs, rate=4.0))    # warm-up
            for rate in RATES:
                specs = wl.with_rate(rate).specs
                live = bench_summary(asyncio.run(run_load(cfg, specs, rate=rate)))
                sim = simulate_run(list(specs), config, cost)
                row = {"policy": name, "rate": rate, "completed": live["completed"],
                       "first_error": next((e for e in live["errors"] if e), "")}
                for k in ("attainment_both", "attainment_ttft", "attainment_tpot", "p90_ttft_ms", "median_tpot_ms"):
                    row[f"live_{k}"], row[f"sim_{k}"] = live[k], sim[k]
                for cls in SLOS:
                    row[f"live_{cls}_both"] = (live["per_class"].get(cls) or {}).get("attainment_both")
                    row[f"sim_{cls}_both"] = (sim["per_class"].get(cls) or {}).get("attainment_both")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        mine = [r for r in rows if r["policy"] == name]
        goodputs[name] = {"live": best_x_meeting(mine, "rate", "live_attainment_both", TARGET),
                          "sim": best_x_meeting(mine, "rate", "sim_attainment_both", TARGET)}
    metrics = {}
    for name, g in goodputs.items():
        metrics[f"{name}: goodput live (req/s)"] = g["live"] if g["live"] is not None else "not met"
        metrics[f"{name}: goodput sim (req/s)"] = g["sim"] if g["sim"] is not None else "not met"
    for r in rows:
        metrics[f"{r['policy']} @ {r['rate']:g}: attainment live / sim"] = (
            f"{r['live_attainment_both']:.3f} / {r['sim_attainment_both']:.3f}")
    cols = ["policy", "rate", "completed", "live_attainment_both", "sim_attainment_both", "live_attainment_ttft",
            "sim_attainment_ttft", "live_attainment_tpot", "sim_attainment_tpot", "live_p90_ttft_ms", "sim_p90_ttft_ms",
            "live_median_tpot_ms", "sim_median_tpot_ms", "live_short_both", "sim_short_both", "live_long_both",
            "sim_long_both"]
    md = (f"1P+1D `laneserve serve` on CPU (small random Qwen2-shaped model, 1 thread per instance), "
          f"{N} requests per rate, short/long mix; goodput = highest swept rate with both-SLO attainment >= {TARGET}.\n\n"
          + ("Notes: " + "; ".join(notes) + "\n\n" if notes else "")
          + markdown_table(rows, cols))
    write_result("serve_live", metrics, markdown=md,
                 extra={"rows": rows, "goodput": goodputs, "notes": notes, "rates": list(RATES), "requests": N,
                        "slo": {k: [v.ttft, v.tpot] for k, v in SLOS.items()}, "profile": str(PROFILE),
                        "model": "Qwen2-shaped 8 layers, hidden 512, vocab 4096, random weights"})


if __name__ == "__main__":
    main()
