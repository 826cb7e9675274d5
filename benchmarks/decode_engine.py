"""Decode policies on the real engine: a 95%-short mix on 1 prefill + 1 decode instance (CPU,
small random-weight model, PADDED attention path, one torch thread per instance).

Continuous batching vs AlignedServe (KV parked in the decode instance's host pool, batches of
similar KV length) vs Kairos (slack-guided, step LUT from this engine's profile). Reports the mean
decode step time and TPOT attainment per policy, and checks that greedy outputs are identical
across policies (scheduling must not change tokens).

    flock /tmp/laneserve-bench.lock python benchmarks/decode_engine.py
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_models import greedy_requests, random_checkpoint  # noqa: E402
from laneserve.measure.metrics import summarize  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.cluster import LocalCluster  # noqa: E402
from laneserve.core import SLO, RequestSpec  # noqa: E402
from laneserve.costmodel.profile import save_profile  # noqa: E402
from laneserve.engine import EngineConfig, EngineExecutor  # noqa: E402
from laneserve.engine.profiler import FULL, EngineProfiler  # noqa: E402

N, RATE, SEED, SHORT_SHARE = 120, 6.0, 0, 0.95
KV_TOKENS, HOST_TOKENS = 65536, 131072
TPOT_SLO = SLO(ttft=30.0, tpot=0.12)


def trace() -> list[RequestSpec]:
    rng = random.Random(SEED)
    t, specs = 0.0, []
    for i in range(N):
        t += rng.expovariate(RATE)
        short = rng.random() < SHORT_SHARE
        specs.append(RequestSpec(i, t, rng.randint(32, 256) if short else rng.randint(2048, 3072),
                                 rng.randint(24, 64), slo=TPOT_SLO, slo_class="short" if short else "long"))
    return specs


def main() -> None:
    torch.set_num_threads(1)
    path = random_checkpoint("small")
    config = EngineConfig(num_threads=1, attention="padded", num_kv_blocks=KV_TOKENS // 16,
                          num_host_blocks=HOST_TOKENS // 16)
    print("profiling the decode path ...", file=sys.stderr)
    grid = dict(FULL, prefill_lens=(64, 256, 1024), cached=(0,), prefill_batches=(),
                decode_batches=(1, 2, 4, 8, 16, 32), decode_ctx=(64, 128, 256, 1024, 2048, 3072), repeats=3)
    profile = EngineProfiler(EngineExecutor.from_pretrained(path, config), repeats=3).run(
        grid, model_name="qwen2-small-random", device="cpu")
    prof_file = Path(tempfile.mkdtemp()) / "profile.json"
    save_profile(profile, prof_file)
    policies = {"continuous": "continuous",
                "alignedserve": "alignedserve-literal:n_min=8,threshold=0.4,starvation_bound=5",
                "kairos": f"kairos:profile={prof_file}"}
    specs = trace()
    rows, outputs = [], {}
    for label, spec in policies.items():
        reqs = greedy_requests(specs, SEED + 1)
        cluster = LocalCluster(path, decode_policy=spec, config=config, kv_tokens=KV_TOKENS)
        done = cluster.run(reqs, timeout=1200)
        dec = cluster.decode[0]
        s = summarize(done)
        outputs[label] = {r.request_id: list(r.output_token_ids) for r in done}
        rows.append({"policy": label, "mean_decode_step_ms": 1e3 * dec.busy_time / max(dec.steps, 1),
                     "decode_steps": dec.steps, "attainment_tpot": s["attainment_tpot"],
                     "median_tpot_ms": s["median_tpot_ms"], "p90_tpot_ms": s["p90_tpot_ms"],
                     "output_throughput": s["output_throughput"], "completed": s["completed"]})
        print(rows[-1], file=sys.stderr, flush=True)
    by = {r["policy"]: r for r in rows}
    identical = all(outputs[p] == outputs["continuous"] for p in outputs)
    metrics = {"identical_greedy_outputs": identical,
               "alignedserve_step_time_ratio": by["alignedserve"]["mean_decode_step_ms"] / by["continuous"]["mean_decode_step_ms"],
               "kairos_tpot_attainment_gain": by["kairos"]["attainment_tpot"] - by["continuous"]["attainment_tpot"],
               "continuous_tpot_attainment": by["continuous"]["attainment_tpot"],
               "mean_step_ms": {p: r["mean_decode_step_ms"] for p, r in by.items()}}
    write_result("decode_engine", metrics, markdown=markdown_table(rows),
                 extra={"rows": rows, "requests": N, "rate": RATE, "short_share": SHORT_SHARE,
                        "tpot_slo": TPOT_SLO.tpot, "attention": "padded", "threads_per_instance": 1,
                        "model": "Qwen2-shaped 8 layers, hidden 512, vocab 4096, random"})


if __name__ == "__main__":
    main()
