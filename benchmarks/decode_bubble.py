"""The decode "bubble": one long context in a batch of short ones, padded vs ragged attention
(AlignedServe §2–3 and Kairos §3 build on it: a padded batch pays for its longest member, a
ragged one for the sum of its contexts).

Decode steps of 32 requests on the CPU engine with a small random-weight model
(``engine_models.py`` "small": Qwen2-shaped, 8 layers, hidden 512, vocab 4096): ``uniform`` = 32
contexts of 128 tokens; ``long`` = 31 of 128 + 1 of 4096.
Each batch runs on the ``padded`` and the ``ragged`` attention path (two executors sharing the
weights, each with the same prefilled KV). A timed step re-runs the same decode (counters are not
advanced, so the contexts stay fixed); the four configurations are interleaved step by step so
drift hits them alike, and each figure is a median.

    python benchmarks/decode_bubble.py                   # ~1 min, 1 torch thread
"""

from __future__ import annotations

import argparse
import statistics

import torch

from engine_models import model_shape, quantile, random_checkpoint
from laneserve.bench.results import markdown_table, write_result
from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.engine import EngineConfig, EngineExecutor, load_model

SHORT, LONG, BATCH = 128, 4096, 32
BLOCK = 16
PATHS = ("padded", "ragged")






def make_requests(vocab: int, seed: int) -> tuple[list[Request], Request]:
    """Prompts one token short of the target context: the decode's newest token completes it."""
    g = torch.Generator().manual_seed(seed)

    def req(rid: int, context: int) -> Request:
        ids = torch.randint(0, vocab, (context - 1,), generator=g).tolist()
        return Request(rid, 0.0, len(ids), 1 << 20, SLO(), prompt_token_ids=ids)

    return [req(i, SHORT) for i in range(BATCH)], req(BATCH, LONG)


def prefill(ex: EngineExecutor, shorts: list[Request], long: Request) -> None:
    """Prefill every request and give it its first output token (as a scheduler's update would)."""
    for group in (shorts, [long]):
        plan = StepPlan()
        for r in group:
            ex.kv.allocate(r.request_id, r.prompt_len + 1)
            plan.prefills.append(PrefillChunk(r, 0, r.prompt_len))
        sampled = ex.execute(plan).sampled
        for r in group:
            if r.num_output_tokens == 0:          # the second executor reuses the first one's tokens
                r.num_computed_tokens = r.prompt_len
                r.record_token(0.0, sampled[r.request_id])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(random_checkpoint("small"))
    shape = model_shape(model)
    shorts, long = make_requests(shape["vocab_size"], args.seed)
    blocks = BATCH * (SHORT // BLOCK + 1) + LONG // BLOCK + 1
    executors = {}
    for path in PATHS:
        cfg = EngineConfig(attention=path, block_size=BLOCK, num_kv_blocks=blocks,
                           max_num_batched_tokens=LONG, num_threads=args.threads)
        executors[path] = EngineExecutor(model, KVCacheManager(blocks, BLOCK), cfg)
        prefill(executors[path], shorts, long)
    print("prefilled", flush=True)

    batches = {"uniform": shorts, "long": shorts[:BATCH - 1] + [long]}
    configs = [(p, b) for p in PATHS for b in batches]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    for step in range(args.warmup + args.steps):
        for path, batch in configs:
            result = executors[path].execute(StepPlan(decodes=batches[batch]))
            if step >= args.warmup:
                times[(path, batch)].append(result.duration)
    med = {c: statistics.median(v) for c, v in times.items()}
    rows = [{"attention": p, "batch": b, "median_ms": med[(p, b)] * 1e3,
             "p10_ms": quantile(times[(p, b)], 0.1) * 1e3, "p90_ms": quantile(times[(p, b)], 0.9) * 1e3}
            for p, b in configs]
    metrics = {
        "padded_long_over_uniform": med[("padded", "long")] / med[("padded", "uniform")],
        "ragged_long_over_uniform": med[("ragged", "long")] / med[("ragged", "uniform")],
        "ragged_over_padded_uniform": med[("ragged", "uniform")] / med[("padded", "uniform")],
        "ragged_over_padded_long": med[("ragged", "long")] / med[("padded", "long")],
        **{f"{p}_{b}_median_ms": med[(p, b)] * 1e3 for p, b in configs},
    }
    for r in rows:
        print(f"{r['attention']:7s} {r['batch']:8s} median {r['median_ms']:7.2f} ms "
              f"(p10 {r['p10_ms']:.2f}, p90 {r['p90_ms']:.2f})")
    print({k: round(v, 3) for k, v in metrics.items() if "over" in k})

    md = (f"Decode step of {BATCH} requests, CPU, {args.threads} torch thread(s), model {shape}. "
          f"uniform = {BATCH} x {SHORT}-token contexts; "
          f"long = {BATCH - 1} x {SHORT} + 1 x {LONG}. {args.steps} interleaved steps per row after "
          f"{args.warmup} warm-up rounds; step time = `EngineStepResult.duration` (prepare, forward, "
          "sampling).\n\n" + markdown_table(rows)
          + "\nFigures are measured, not asserted.\n")
    write_result("decode_bubble", metrics, markdown=md, extra={
        "threads": args.threads, "model": shape,
        "batch": BATCH, "short_context": SHORT, "long_context": LONG, "steps": args.steps,
        "warmup": args.warmup, "seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()
