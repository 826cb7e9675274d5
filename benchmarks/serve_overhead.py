"""Front-end overhead: requests per second the API + router sustain, and the latency they add per
request, measured against STUB instances that answer at once (``laneserve serve --stub``: a
measurement harness that echoes the prompt, no model) — so every millisecond measured is HTTP
parsing, validation, routing, ZeroMQ messaging (prefill -> router -> decode hand-off included in
the 1P+1D case), SSE framing and the client.

- latency: one request at a time (streamed, 32-token prompt, 16 output tokens); the E2E latency
  against the stub is the added latency per request; ``/health`` round trips give the bare HTTP
  floor of the same client and server.
- throughput: the same requests under concurrency 1..64 (``laneserve bench``'s load generator).

The load generator runs on the same 2-core machine (shared with other work), so figures are a
lower bound of what the front end sustains alone.

    flock /tmp/laneserve-bench.lock .venv/bin/python benchmarks/serve_overhead.py
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from laneserve.bench.loadgen import LoadConfig, bench_summary, run_load  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.core import SLO, RequestSpec  # noqa: E402

CONCURRENCY = (1, 4, 16, 64)
PROMPT, OUTPUT = 32, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "laneserve.cli", "serve", "--stub", "--port", str(port),
                             "--max-inflight", "4096", *args], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("stub server did not start")


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(i, 0.0, PROMPT, OUTPUT, slo=SLO(1.0, 0.1)) for i in range(n)]


def measure(name: str, args: tuple[str, ...]) -> list[dict]:
    proc, url = start(*args)
    rows = []
    try:
        with httpx.Client(timeout=10) as client:
            for _ in range(50):
                client.get(url + "/health")
            rtts = []
            for _ in range(300):
                t = time.perf_counter()
                client.get(url + "/health")
                rtts.append(time.perf_counter() - t)
        health_ms = 1e3 * statistics.median(rtts)
        cfg = LoadConfig(base_url=url, progress=False, max_concurrency=1)
        asyncio.run(run_load(cfg, specs(50), rate=float("inf")))          # warm-up
        for conc in CONCURRENCY:
            n = max(300, 40 * conc)
            cfg = LoadConfig(base_url=url, progress=False, max_concurrency=conc)
            s = bench_summary(asyncio.run(run_load(cfg, specs(n), rate=float("inf"))))
            rows.append({"deployment": name, "concurrency": conc, "requests": n, "failed": s["failed"],
                         "request_throughput": s["request_throughput"], "median_e2el_ms": s["median_e2el_ms"],
                         "p99_e2el_ms": s["p99_e2el_ms"], "median_ttft_ms": s["median_ttft_ms"],
                         "health_rtt_ms": health_ms})
            print(rows[-1], file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    return rows


def main() -> None:
    rows = measure("1P+1D stub (processes)", ("--prefill", "1", "--decode", "1"))
    rows += measure("colocated stub (1 process)", ("--colocated",))
    pd = [r for r in rows if r["deployment"].startswith("1P")]
    colo = [r for r in rows if r["deployment"].startswith("colocated")]
    metrics = {
        "pd_max_request_throughput": max(r["request_throughput"] for r in pd),
        "pd_added_latency_ms": pd[0]["median_e2el_ms"],
        "pd_added_latency_over_http_floor_ms": pd[0]["median_e2el_ms"] - pd[0]["health_rtt_ms"],
        "colocated_max_request_throughput": max(r["request_throughput"] for r in colo),
        "colocated_added_latency_ms": colo[0]["median_e2el_ms"],
        "http_floor_health_rtt_ms": pd[0]["health_rtt_ms"],
    }
    for k, v in metrics.items():
        print(f"{k:40s} {v:.3f}")
    md = ("STUB instances (a measurement harness that echoes at once; no model). Streamed completions, "
          f"{PROMPT}-token prompts, {OUTPUT} output tokens; the load generator shares the 2-core machine.\n\n"
          + markdown_table(rows))
    write_result("serve_overhead", metrics, markdown=md,
                 extra={"rows": rows, "harness": "laneserve serve --stub (echo instances, no model)",
                        "prompt_tokens": PROMPT, "output_tokens": OUTPUT})


if __name__ == "__main__":
    main()
