"""What the Ray deployment costs, on one machine with a Ray cluster simulated on it
(``ray.cluster_utils.Cluster``: a head, a node offering ``laneserve_prefill``, one offering
``laneserve_decode``; each node has its own raylet and object store, so KV really moves between
object stores):

- latency: the smoke model served 1P+1D by ``laneserve serve --ray-address`` (actors, ZeroMQ over
  TCP, KV through the object stores) and by the single-machine deployment (processes, ZeroMQ over
  unix sockets, KV through /dev/shm); sequential requests (streamed; 64-token prompt, 16 output
  tokens, greedy), so each figure is one request alone; TTFT includes the prefill -> decode hand-off
  only for the second token, so the E2E latency is the one to read.
- KV transfer throughput: one payload put by an actor on the prefill node and taken by an actor on
  the decode node (``ray`` transport: put + claim + get + copy out), against the ``shm`` transport
  (put + get in one process: the single-machine path) — payload sizes 1, 16 and 64 MB.
- sweep: ``laneserve sim`` (3 policies x 4 rates, 6,000 Azure requests) in one process vs as Ray
  tasks on the head node (one CPU per core of this machine); rows and metrics must be identical
  (the markdown differs only in the command line it records).

The machine is shared (2 cores, other work running), so each figure is a median of repeats and
the ratios matter more than the absolute values.

    flock /tmp/laneserve-bench.lock env PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/ray_overhead.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray.cluster_utils import Cluster

from laneserve.bench.live_server import Server
from laneserve.bench.results import markdown_table, write_result
from laneserve.cluster.ray_cluster import InstanceHost
from laneserve.cluster.ray_kv import RayObjectTransport
from laneserve.cluster.transport import ShmFileTransport

STORE = 300 << 20
REQUESTS = 40
SIZES_MB = (1, 16, 64)
REPEATS = 5
MODEL = "smoke-llama"


class KVEndpoint(InstanceHost):
    """An instance actor's KV side alone: puts payloads (prefill node) or takes them (decode node)."""

    def put(self, nbytes: int) -> dict:
        import torch

        from laneserve.engine.kv_cache import KVPayload
        transport = RayObjectTransport(owner=ray.get_runtime_context().get_actor_name())
        return transport.put(0, KVPayload(1, torch.ones(nbytes // 4, dtype=torch.float32)))

    def take(self, desc: dict) -> float:
        transport = RayObjectTransport(owner=ray.get_runtime_context().get_actor_name())
        t0 = time.perf_counter()
        payload = transport.get(desc)
        assert payload.kv.numel() * 4 == desc["bytes"]
        return time.perf_counter() - t0


def stream_latency(server: Server) -> tuple[float, float]:
    """(TTFT, E2E) in seconds of one streamed greedy request."""
    body = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


def latency(cluster: Cluster) -> list[dict]:
    servers = {"zeromq (processes, shm)": Server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384"),
               "ray (actors on 2 nodes)": Server("--ray-address", cluster.address, "--kv-tokens", "16384")}
    rows = []
    try:
        for s in servers.values():
            s.wait_ready()
        for name, s in servers.items():
            for _ in range(5):
                stream_latency(s)                           # warm-up
        samples = {name: [] for name in servers}
        for _ in range(REQUESTS):                           # interleaved: load drifts hit both alike
            for name, s in servers.items():
                samples[name].append(stream_latency(s))
        for name, xs in samples.items():
            e2e = sorted(x[1] for x in xs)
            rows.append({"deployment": name, "ttft_p50_ms": 1e3 * statistics.median(x[0] for x in xs),
                         "e2e_p50_ms": 1e3 * statistics.median(e2e), "e2e_p90_ms": 1e3 * e2e[int(0.9 * len(e2e))],
                         "requests": len(xs)})
    finally:
        for s in servers.values():
            s.stop()
    return rows


def kv_throughput() -> list[dict]:
    src = ray.remote(KVEndpoint).options(name="bench-kv-prefill", resources={"laneserve_prefill": 1}, num_cpus=0,
                                         max_concurrency=2).remote()
    dst = ray.remote(KVEndpoint).options(name="bench-kv-decode", resources={"laneserve_decode": 1}, num_cpus=0,
                                         max_concurrency=2).remote()
    assert ray.get(src.node_id.remote()) != ray.get(dst.node_id.remote())
    import torch

    from laneserve.engine.kv_cache import KVPayload
    rows = []
    shm = ShmFileTransport(tempfile.mkdtemp(prefix="bench-kv-", dir="/dev/shm"))
    for mb in SIZES_MB:
        nbytes = mb << 20
        ray_s, shm_s = [], []
        payload = KVPayload(1, torch.ones(nbytes // 4, dtype=torch.float32))
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            desc = ray.get(src.put.remote(nbytes))
            put_s = time.perf_counter() - t0
            ray_s.append(put_s + ray.get(dst.take.remote(desc)))
            t0 = time.perf_counter()
            shm.get(shm.put(0, payload))
            shm_s.append(time.perf_counter() - t0)
        r, s = statistics.median(ray_s), statistics.median(shm_s)
        rows.append({"payload_mb": mb, "ray_ms": 1e3 * r, "shm_ms": 1e3 * s, "ray_mb_per_s": mb / r,
                     "shm_mb_per_s": mb / s, "shm_over_ray": r / s})
        print(f"KV {mb} MB: ray {1e3 * r:.1f} ms, shm {1e3 * s:.1f} ms", flush=True)
    for a in (src, dst):
        ray.kill(a)
    return rows


def sweep_speedup(address: str, cores: int) -> list[dict]:
    cmd = [sys.executable, "-m", "laneserve.cli", "sim", "--num-requests", "6000", "--no-progress",
           "--policies", "fcfs+continuous,cp-edf-2k+continuous,cp-edf-8k+continuous"]
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("one process", ["--jobs", "1"]), (f"ray tasks ({cores} CPUs)", ["--ray-address", address])):
            out = f"{tmp}/{len(rows)}"
            t0 = time.perf_counter()
            subprocess.run([*cmd, *extra, "--output", out], check=True, stdout=subprocess.DEVNULL)
            rows.append({"run": name, "wall_s": time.perf_counter() - t0})
            data = json.loads(Path(f"{out}/sim.json").read_text())
            outputs[name] = (data["rows"], data["metrics"])
    one, par = outputs.values()
    assert one == par, "the Ray sweep differs from the one-process sweep"
    for r in rows:
        r["speedup"] = rows[0]["wall_s"] / r["wall_s"]
    return rows


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cores, "object_store_memory": STORE})
    try:
        for res in ("laneserve_prefill", "laneserve_decode"):
            cluster.add_node(num_cpus=0, resources={res: 1}, object_store_memory=STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning")
        lat = latency(cluster)
        print(markdown_table(lat), flush=True)
        kv = kv_throughput()
        ray.shutdown()
        sweep = sweep_speedup(cluster.address, cores)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(markdown_table(sweep), flush=True)
    zmq, rayd = lat
    big = kv[-1]
    metrics = {"ray_added_e2e_ms_p50": rayd["e2e_p50_ms"] - zmq["e2e_p50_ms"],
               "ray_e2e_over_zeromq_p50": rayd["e2e_p50_ms"] / zmq["e2e_p50_ms"],
               "kv_ray_mb_per_s_64mb": big["ray_mb_per_s"], "kv_shm_mb_per_s_64mb": big["shm_mb_per_s"],
               "sweep_speedup_ray": sweep[-1]["speedup"]}
    write_result("ray_overhead", metrics, extra={"latency": lat, "kv_transfer": kv, "sweep": sweep},
                 markdown="## Per-request latency, 1P+1D smoke model (sequential, streamed)\n\n"
                          + markdown_table(lat) + "\n## KV transfer, prefill node -> decode node\n\n"
                          + markdown_table(kv) + "\n## laneserve sim sweep (3 policies x 4 rates, 6,000 requests)\n\n"
                          + markdown_table(sweep))


if __name__ == "__main__":
    main()
