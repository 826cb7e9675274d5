"""MoE layer step time on CPU: the engine's grouped path (pairs sorted by expert, one GEMM per
non-empty expert over contiguous rows: ``engine/models/moe.py``) against a loop over all experts
that masks the batch for each (the per-expert loop of the Hugging Face reference), same weights,
same routing, same process. Both include the router. A Qwen3-30B-A3B-like layer scaled down
to CPU size (128 experts, top-8, hidden 512, expert intermediate 192, fp32).

    PYTHONPATH=. python benchmarks/moe_step.py     # writes benchmarks/results/moe_step.{json,md}
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import timeit
from pathlib import Path

import torch

from laneserve.engine.models.moe import MoEWeights, moe_down, moe_gate_up, reference_moe

OUT = Path(__file__).resolve().parent / "results"
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 512, 192
BATCHES = (1, 8, 32, 128, 512)
REPEATS = 11


def layer(seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(EXPERTS, HIDDEN, generator=g),
                      gate_up=torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5,
                      down=torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5,
                      top_k=TOP_K, renormalize=True)


def interleaved(a, b, number: int) -> tuple[float, float, float]:
    """Seconds per call of ``a`` and ``b`` (best of REPEATS), timed alternately so both see the same
    machine load, and the median of the per-round ratios ``b / a``."""
    a(), b()
    ta, tb = [], []
    for _ in range(REPEATS):
        ta.append(timeit.timeit(a, number=number) / number)
        tb.append(timeit.timeit(b, number=number) / number)
    return min(ta), min(tb), statistics.median(y / x for x, y in zip(ta, tb))


def main() -> int:
    torch.set_num_threads(1)
    moe = layer()
    rows = []
    with torch.inference_mode():
        for n in BATCHES:
            x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n))
            grouped, loop, ratio = interleaved(lambda x=x: moe_down(moe_gate_up(x, moe), moe),
                                               lambda x=x: reference_moe(x, moe), 2)
            err = (moe_down(moe_gate_up(x, moe), moe) - reference_moe(x, moe)).abs().max().item()
            touched = int(torch.topk(x @ moe.router.T, TOP_K).indices.unique().numel())
            rows.append({"tokens": n, "experts_touched": touched, "grouped_ms": grouped * 1e3,
                         "expert_loop_ms": loop * 1e3, "loop_over_grouped": ratio, "max_abs_diff": err})
    OUT.mkdir(exist_ok=True)
    meta = {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "expert_intermediate": INTER, "dtype": "float32",
            "threads": 1, "torch": torch.__version__, "machine": f"{platform.machine()}, Python {platform.python_version()}"}
    (OUT / "moe_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# moe_step", "", "Command: `PYTHONPATH=. python benchmarks/moe_step.py`  ",
             f"One MoE layer (router + gate/up + down), {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, "
             f"expert intermediate {INTER}, fp32, 1 thread; the two paths timed alternately, {REPEATS} rounds "
             f"(times: best round; ratio: median of the rounds' ratios); {meta['machine']}, "
             f"torch {torch.__version__}", "",
             "| tokens | experts touched | grouped, sorted by expert (ms) | loop over all experts (ms) | loop / grouped "
             "| max abs diff |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['experts_touched']} | {r['grouped_ms']:.3f} | {r['expert_loop_ms']:.3f} "
              f"| {r['loop_over_grouped']:.2f}x | {r['max_abs_diff']:.1e} |" for r in rows]
    (OUT / "moe_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
