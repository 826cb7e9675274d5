"""CUDA graphs for the engine's shape buckets (``laneserve/engine/graphs.py``; LAPS §3): step latency
of the eager path vs graph replay, per decode bucket ``(B, C)`` and per LAPS short-prefill bucket
``(L, B)``, on a small random-weight model, with a token identity check between the two paths.

CUDA only: on a machine without CUDA it prints a message and exits 0 without writing results
(``--cpu-check`` runs the same measurement loop on CPU at a tiny size, as a smoke test of this
script; it writes nothing either).

    flock /tmp/laneserve-bench.lock python benchmarks/cuda_graphs.py

Method: one model, two executors (``cuda_graphs=False`` with the padded attention path, and
``cuda_graphs=True``), each with its own KV. Per decode bucket, ``B`` requests with contexts spread
over ``(C/2, C - steps]`` are prefilled one by one, then decoded together for ``warmup + steps``
steps; the first graph step captures the bucket (its extra time is reported as ``capture_s``).
The step time is ``EngineStepResult.duration``: host preparation + forward (replay) + greedy
sampling, synchronised — what the scheduler observes. Per prefill bucket, fresh batches of ``B``
prompts (lengths in ``(L/2, L]``) run as LAPS plans with ``padded_shape=(L, B)``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_models import model_shape, quantile, random_checkpoint  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.core.kv import KVCacheManager  # noqa: E402
from laneserve.core.plan import PrefillChunk, StepPlan  # noqa: E402
from laneserve.core.request import Request  # noqa: E402
from laneserve.core.sampling import SamplingParams  # noqa: E402
from laneserve.core.slo import SLO  # noqa: E402
from laneserve.engine import EngineConfig, EngineExecutor, load_model  # noqa: E402

BLOCK = 16
_ids = iter(range(1 << 40))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]  # type: ignore[misc]


def make_request(prompt: list[int], max_tokens: int) -> Request:
    req = Request(request_id=next(_ids), arrival_time=0.0, prompt_len=len(prompt), max_output_tokens=max_tokens,
                  slo=SLO(), prompt_token_ids=list(prompt))
    req.sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return req


def prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in lengths]


def spread(lo: int, hi: int, count: int) -> list[int]:
    """``count`` lengths spread evenly over ``[lo, hi]`` (the last one is ``hi``)."""
    if count == 1:
        return [hi]
    return [lo + (hi - lo) * i // (count - 1) for i in range(count)]


def decode_bucket(ex: EngineExecutor, batch: int, context: int, warmup: int, steps: int, seed: int,
                  vocab: int) -> tuple[list[float], list[list[int]]]:
    """Prefill ``batch`` requests, decode them together; returns step times and tokens per step."""
    longest = context - warmup - steps - 1
    reqs = [make_request(p, warmup + steps + 1)
            for p in prompts(spread(context // 2 + 1, longest, batch), seed, vocab)]
    for r in reqs:                                    # prefill one by one (eager either way)
        ex.kv.allocate(r.request_id, r.prompt_len)
        res = ex.execute(StepPlan(prefills=[PrefillChunk(r, 0, r.prompt_len)]))
        r.num_computed_tokens = r.prompt_len
        r.record_token(0.0, res.sampled[r.request_id])
    times, tokens = [], []
    for step in range(warmup + steps):
        for r in reqs:
            ex.kv.allocate(r.request_id, r.context_len)
        res = ex.execute(StepPlan(decodes=list(reqs)))
        times.append(res.duration)
        tokens.append([res.sampled[r.request_id] for r in reqs])
        for r in reqs:
            r.num_computed_tokens += 1
            r.record_token(float(step + 1), res.sampled[r.request_id])
    for r in reqs:
        ex.kv.free(r.request_id)
    return times, tokens


def prefill_bucket(ex: EngineExecutor, length: int, batch: int, real: int, warmup: int, steps: int, seed: int,
                   vocab: int) -> tuple[list[float], list[list[int]]]:
    """``warmup + steps`` LAPS plans of ``real`` fresh prompts padded to ``(length, batch)``."""
    times, tokens = [], []
    for rep in range(warmup + steps):
        reqs = [make_request(p, 1) for p in prompts(spread(length // 2 + 1, length, real), seed + rep, vocab)]
        for r in reqs:
            ex.kv.allocate(r.request_id, r.prompt_len)
        plan = StepPlan(prefills=[PrefillChunk(r, 0, r.prompt_len) for r in reqs], padded_shape=(length, batch))
        res = ex.execute(plan)
        times.append(res.duration)
        tokens.append([res.sampled[r.request_id] for r in reqs])
        for r in reqs:
            ex.kv.free(r.request_id)
    return times, tokens


def row_stats(label: dict, eager: list[float], graph: list[float], warmup: int,
              eager_tok: list, graph_tok: list) -> dict:
    e, g = eager[warmup:], graph[warmup:]
    e_med, g_med = statistics.median(e), statistics.median(g)
    pairs = [(a, b) for sa, sb in zip(eager_tok, graph_tok) for a, b in zip(sa, sb)]
    return label | {"eager_ms": 1e3 * e_med, "graph_ms": 1e3 * g_med, "speedup": e_med / g_med,
                    "eager_p90_ms": 1e3 * quantile(e, 0.9), "graph_p90_ms": 1e3 * quantile(g, 0.9),
                    "capture_s": max(graph[0] - g_med, 0.0),
                    "token_match": sum(a == b for a, b in pairs) / max(len(pairs), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", help="random checkpoint shape (benchmarks/engine_models.py)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4,16,24,64", help="decode batch sizes (a non-power of two pads)")
    ap.add_argument("--contexts", default="128,512,2048", help="decode context buckets C")
    ap.add_argument("--prefill-shapes", default="32x8,64x16,128x4,256x2", help="LAPS (L)x(B) prefill buckets")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per bucket")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per bucket (the first one captures)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-check", action="store_true",
                    help="run a tiny version on CPU to check this script (writes no results)")
    args = ap.parse_args()

    if args.cpu_check:
        device, dtype = "cpu", "float32"
        args.shape, args.batches, args.contexts, args.prefill_shapes = "tiny", "1,3", "32", "8x2,16x4"
        args.steps, args.warmup = 3, 2
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("cuda_graphs: no CUDA device here; CUDA graphs are captured only on CUDA (the CPU runs the same "
              "static bucket path eagerly, see tests/test_engine_graphs.py). Nothing measured, no results written.")
        return 0
    else:
        device, dtype = "cuda", args.dtype
    batches, contexts, pshapes = _ints(args.batches), _ints(args.contexts), _shapes(args.prefill_shapes)
    for c in contexts:
        if c // 2 + 1 > c - args.warmup - args.steps - 1:
            raise SystemExit(f"context {c} is too short for {args.warmup} + {args.steps} decode steps")

    path = random_checkpoint(args.shape)
    model = load_model(path, device, dtype)
    vocab = model.config.vocab_size
    pow2 = lambda n: 1 << max(n - 1, 0).bit_length()  # noqa: E731
    kv_tokens = max(max(batches) * max(contexts), max(pow2(b) * length for length, b in pshapes)) * 2
    num_blocks = kv_tokens // BLOCK
    grid = dict(graph_max_batch=pow2(max(batches)), graph_max_context=max(16, pow2(max(contexts))),
                graph_max_prefill_len=max(8, pow2(max(length for length, _ in pshapes))),
                graph_max_prefill_batch=pow2(max(b for _, b in pshapes)))
    executors = {}
    for graphs in (False, True):
        cfg = EngineConfig(device=device, dtype=dtype, block_size=BLOCK, num_kv_blocks=num_blocks,
                           attention="padded", cuda_graphs=graphs, num_threads=1 if device == "cpu" else None, **grid)
        executors[graphs] = EngineExecutor(model, KVCacheManager(num_blocks, BLOCK), cfg)

    decode_rows, prefill_rows = [], []
    for c in contexts:
        for b in batches:
            runs = {g: decode_bucket(ex, b, c, args.warmup, args.steps, args.seed + b * 7919 + c, vocab)
                    for g, ex in executors.items()}
            row = row_stats({"batch": b, "bucket": f"({pow2(b)}, {c})", "context": c}, runs[False][0], runs[True][0],
                            args.warmup, runs[False][1], runs[True][1])
            decode_rows.append(row)
            print(row, file=sys.stderr, flush=True)
    for length, b in pshapes:
        real = max(1, (3 * b + 3) // 4)                    # a quarter of the rows are padding sequences
        runs = {g: prefill_bucket(ex, length, b, real, args.warmup, args.steps, args.seed + length * 31 + b, vocab)
                for g, ex in executors.items()}
        row = row_stats({"bucket": f"({length}, {b})", "real_seqs": real}, runs[False][0], runs[True][0],
                        args.warmup, runs[False][1], runs[True][1])
        prefill_rows.append(row)
        print(row, file=sys.stderr, flush=True)

    stats = executors[True].runner.graphs.stats
    speedups = [r["speedup"] for r in decode_rows]
    all_rows = decode_rows + prefill_rows
    metrics = {
        "decode_speedup_median": statistics.median(speedups),
        "decode_speedup_min": min(speedups), "decode_speedup_max": max(speedups),
        "decode_speedup_batch1": statistics.median([r["speedup"] for r in decode_rows if r["batch"] == 1] or [0.0]),
        "prefill_speedup_median": statistics.median([r["speedup"] for r in prefill_rows] or [0.0]),
        "token_match_min": min(r["token_match"] for r in all_rows),
        "tokens_identical": all(r["token_match"] == 1.0 for r in all_rows),
        "graphs_captured": stats.captures, "graph_replays": stats.replays, "fallback_steps": stats.fallbacks,
    }
    cols = ["batch", "bucket", "eager_ms", "graph_ms", "speedup", "eager_p90_ms", "graph_p90_ms", "capture_s",
            "token_match"]
    markdown = ("## Decode steps (eager padded path vs CUDA graph replay)\n\n" + markdown_table(decode_rows, cols)
                + "\n## LAPS short-prefill buckets\n\n"
                + markdown_table(prefill_rows, ["bucket", "real_seqs"] + cols[2:])
                + "\nStep time = `EngineStepResult.duration` (host preparation + forward/replay + greedy "
                  "sampling, synchronised); medians over the timed steps. `capture_s`: extra time of the first "
                  "graph step (warm-up + capture). `token_match`: share of greedy tokens equal between the paths "
                  f"({dtype}: the two paths pad attention differently, so rare low-margin flips are possible).\n")
    if args.cpu_check:
        print(markdown)
        print(metrics)
        print("cpu-check done: nothing written")
        return 0
    extra = {"model": model_shape(model), "device": torch.cuda.get_device_name(), "grid": grid,
             "steps": args.steps, "warmup": args.warmup, "decode": decode_rows, "prefill": prefill_rows,
             "date": time.strftime("%Y-%m-%d")}
    print(write_result("cuda_graphs", metrics, markdown=markdown, extra=extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
