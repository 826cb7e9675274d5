"""Twin check: the simulator, fed this engine's own profile, against the real engine.

A short mixed short/long trace is replayed on a real 1 prefill + 1 decode cluster (CPU, small
random-weight Qwen2-shaped model, one torch thread per instance) and in the simulator with a
FittedCostModel built from `laneserve profile`-style measurements of the same engine. Reports the
per-request relative TTFT and TPOT error (median, P90) and the difference in SLO attainment.
Targets: metrics.ttft_median_rel_err <= 0.10, metrics.attainment_abs_diff <= 0.05.

    python benchmarks/twin_check.py
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_models import greedy_requests, random_checkpoint  # noqa: E402
from laneserve.measure.metrics import request_metrics, summarize  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.cluster import LocalCluster  # noqa: E402
from laneserve.core import SLO, RequestSpec  # noqa: E402
from laneserve.costmodel.fitted import FittedCostModel  # noqa: E402
from laneserve.engine import EngineConfig, EngineExecutor  # noqa: E402
from laneserve.engine.profiler import FULL, EngineProfiler  # noqa: E402
from laneserve.sim import ClusterConfig, Simulator  # noqa: E402

N, RATE, SEED = 80, 2.0, 0
KV_TOKENS = 65536
SLO_TARGET = SLO(ttft=0.5, tpot=0.05)


def trace() -> list[RequestSpec]:
    rng = random.Random(SEED)
    t, specs = 0.0, []
    for i in range(N):
        t += rng.expovariate(RATE)
        long = rng.random() < 0.15
        specs.append(RequestSpec(i, t, rng.randint(1024, 2048) if long else rng.randint(16, 256),
                                 rng.randint(8, 48), slo=SLO_TARGET))
    return specs


def main() -> None:
    torch.set_num_threads(1)
    path = random_checkpoint("small")
    config = EngineConfig(num_threads=1, num_kv_blocks=KV_TOKENS // 16)
    grid = dict(FULL, prefill_lens=(16, 32, 64, 128, 256, 512, 1024, 2048), cached=(0,),
                decode_ctx=(32, 128, 512, 1024, 2048), decode_batches=(1, 2, 4, 8, 16))
    print("profiling the engine ...", file=sys.stderr)
    profile = EngineProfiler(EngineExecutor.from_pretrained(path, config), repeats=5).run(
        grid, model_name="qwen2-small-random", device="cpu")
    cost = FittedCostModel(profile)

    specs = trace()
    reqs = greedy_requests(specs, SEED + 1)
    print(f"replaying {N} requests on the engine (1P+1D) ...", file=sys.stderr)
    cluster = LocalCluster(path, config=config, kv_tokens=KV_TOKENS)
    real = {r.request_id: r for r in cluster.run(reqs, timeout=900)}
    # the simulator sees the same arrival offsets as the real replay
    sim_res = Simulator(ClusterConfig(prefill_kv_tokens=KV_TOKENS, decode_kv_tokens=KV_TOKENS,
                                      kv_link="host"), cost).run(specs)
    sim = {r.request_id: r for r in sim_res.requests}

    rows, ttft_err, tpot_err = [], [], []
    for rid in sorted(real):
        mr, ms = request_metrics(real[rid]), request_metrics(sim[rid])
        te = abs(ms.ttft - mr.ttft) / mr.ttft
        ttft_err.append(te)
        pe = abs(ms.tpot - mr.tpot) / mr.tpot if mr.tpot and ms.tpot else None
        if pe is not None:
            tpot_err.append(pe)
        rows.append({"id": rid, "prompt": real[rid].prompt_len, "out": real[rid].max_output_tokens,
                     "ttft_real_ms": 1e3 * mr.ttft, "ttft_sim_ms": 1e3 * ms.ttft,
                     "tpot_real_ms": 1e3 * (mr.tpot or 0), "tpot_sim_ms": 1e3 * (ms.tpot or 0)})
    s_real = summarize(list(real.values()))
    s_sim = summarize(sim_res.requests)

    def q(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    metrics = {"ttft_median_rel_err": statistics.median(ttft_err), "ttft_p90_rel_err": q(ttft_err, 0.9),
               "tpot_median_rel_err": statistics.median(tpot_err), "tpot_p90_rel_err": q(tpot_err, 0.9),
               "attainment_real": s_real["attainment_both"], "attainment_sim": s_sim["attainment_both"],
               "attainment_abs_diff": abs(s_real["attainment_both"] - s_sim["attainment_both"]),
               "real_p90_ttft_ms": s_real["p90_ttft_ms"], "sim_p90_ttft_ms": s_sim["p90_ttft_ms"],
               "real_median_tpot_ms": s_real["median_tpot_ms"], "sim_median_tpot_ms": s_sim["median_tpot_ms"]}
    for k, v in metrics.items():
        print(f"{k:24s} {v:.4g}")
    write_result("twin_check", metrics, extra={"requests": N, "rate": RATE, "slo": [SLO_TARGET.ttft, SLO_TARGET.tpot],
                                               "model": "Qwen2-shaped 8 layers, hidden 512, vocab 4096, random",
                                               "threads_per_instance": 1, "rows": rows},
                 markdown=markdown_table(rows[:40]))


if __name__ == "__main__":
    main()
