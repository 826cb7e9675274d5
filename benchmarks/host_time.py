"""Host time per layer of an eager engine step: the engine as it is (the working tree) against the
engine at a baseline revision (``--baseline-rev``, extracted with ``git archive`` into a temporary
folder and measured in a subprocess; the working tree is not touched), and against the bare
operator loop (the model's operator generator on prebuilt step tensors: no step preparation, no
sampling), the floor of what a step can cost on the host.

The model is ``engine_models.py`` "tiny32" (Qwen2-shaped, 32 layers of hidden 64, vocab 4096), so
that on the CPU a step's time is almost all host work (Python, dispatch, metadata), which is what
a GPU step pays on the host before its kernels run. Steps (greedy, ragged attention, eager):

* ``decode``: 4 requests decoding over ~128-token contexts, one token each;
* ``mixed``: a 32-token chunk over a 96-token cached prefix, a fresh 32-token prompt, 2 decodes.

Each measurement is the median of ``--steps`` timed steps after warm-up, 1 torch thread, in a
fresh interpreter; the variants alternate over ``--rounds`` rounds and each figure is the smallest
over the rounds (the machine is shared: a round's median can double under outside load).

    python benchmarks/host_time.py                     # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE_REV = "3b87678"     # the engine before one-sync steps, pinned uploads and vectorised metadata


def measure(checkpoint: str, steps: int) -> dict:
    """Median step time (s) of the decode and mixed steps, and of the bare operator loop."""
    import torch

    from laneserve.core.plan import PrefillChunk, StepPlan
    from laneserve.core.request import Request
    from laneserve.core.sampling import SamplingParams
    from laneserve.core.slo import SLO
    from laneserve.engine import EngineConfig, EngineExecutor
    from laneserve.engine.runner import plan_sequences

    torch.set_num_threads(1)
    cfg = EngineConfig(block_size=16, num_kv_blocks=512, max_num_batched_tokens=1024, num_threads=1,
                       attention="ragged", dtype="float32")
    ex = EngineExecutor.from_pretrained(checkpoint, cfg)
    vocab = ex.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rid = [0]

    def request(prompt_len: int, max_tokens: int = 1 << 20) -> Request:
        req = Request(rid[0], 0.0, prompt_len, max_tokens, SLO(),
                      prompt_token_ids=torch.randint(1, vocab, (prompt_len,), generator=g).tolist())
        req.sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rid[0] += 1
        return req

    def run(plan: StepPlan):
        for c in plan.prefills:
            ex.kv.allocate(c.request.request_id, c.end)
        for r in plan.decodes:
            ex.kv.allocate(r.request_id, r.context_len)
        t0 = time.perf_counter()
        result = ex.execute(plan)
        elapsed = time.perf_counter() - t0
        for c in plan.prefills:
            c.request.num_computed_tokens = c.end
            if c.end >= c.request.prompt_len:
                c.request.record_token(1.0, result.sampled[c.request.request_id])
        for r in plan.decodes:
            r.num_computed_tokens += 1
            r.record_token(1.0, result.sampled[r.request_id])
        return elapsed

    def prefilled(prompt_len: int) -> Request:
        req = request(prompt_len)
        run(StepPlan([PrefillChunk(req, 0, prompt_len)]))
        return req

    out = {}
    # decode: 4 requests over ~128-token contexts
    decodes = [prefilled(120 + 4 * i) for i in range(4)]
    for _ in range(3):
        run(StepPlan(decodes=list(decodes)))
    out["decode"] = statistics.median(run(StepPlan(decodes=list(decodes))) for _ in range(steps))
    # the bare operator loop over the same decode step's tensors, prepared once
    plan = StepPlan(decodes=list(decodes))
    for r in decodes:
        ex.kv.allocate(r.request_id, r.context_len)
    with torch.inference_mode():
        tensors = ex.runner.prepare(plan_sequences(plan, ex.kv))
        bare = []
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            for _op in ex.model.steps(tensors, ex.runner.cache, ex.runner.attention):
                pass
            bare.append(time.perf_counter() - t0)
    out["bare_decode_loop"] = statistics.median(bare[3:])
    # mixed: a chunk over a cached prefix, a fresh prompt, two decodes (fresh requests each step)
    times = []
    for i in range(steps + 3):
        cached = request(128, 1)
        run(StepPlan([PrefillChunk(cached, 0, 96)]))
        fresh = request(32, 1)
        plan = StepPlan([PrefillChunk(cached, 96, 32), PrefillChunk(fresh, 0, 32)], decodes=decodes[:2])
        times.append(run(plan))
        for r in (cached, fresh):
            ex.kv.free(r.request_id)
    out["mixed"] = statistics.median(times[3:])
    out["num_layers"] = ex.model.config.num_layers
    return out


def measure_in_subprocess(package_root: str, checkpoint: str, steps: int) -> dict:
    """``measure`` in a fresh interpreter with the ``laneserve`` package under ``package_root``
    first on the path (both variants are measured the same way)."""
    env = dict(os.environ, PYTHONPATH=package_root)
    done = subprocess.run([sys.executable, __file__, "--measure-only", "--checkpoint", checkpoint,
                           "--steps", str(steps)], env=env, cwd=package_root, check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def extract(rev: str, folder: str) -> None:
    """The ``laneserve`` package at git revision ``rev`` into ``folder``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "laneserve"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurements per variant")
    parser.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision measured as 'before' ('' to skip)")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.checkpoint, args.steps)))
        return
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    from engine_models import random_checkpoint

    from laneserve.bench.results import markdown_table, write_result
    checkpoint = str(random_checkpoint("tiny32"))
    variants = {}
    with tempfile.TemporaryDirectory(prefix="laneserve-host-time-") as tmp:
        if args.baseline_rev:
            extract(args.baseline_rev, tmp)
            variants[f"before ({args.baseline_rev})"] = tmp
        variants["after (working tree)"] = str(REPO)
        # rounds alternate the variants, so load from elsewhere on the machine hits both alike;
        # each figure is the least disturbed (smallest) over the rounds
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for i in range(args.rounds):
            for variant, root in variants.items():
                runs[variant].append(measure_in_subprocess(root, checkpoint, args.steps))
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    results = {v: {k: min(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    rows = []
    for variant, r in results.items():
        layers = r["num_layers"]
        rows.append({"engine": variant, "decode_step_ms": r["decode"] * 1e3,
                     "decode_us_per_layer": r["decode"] / layers * 1e6,
                     "mixed_step_ms": r["mixed"] * 1e3, "mixed_us_per_layer": r["mixed"] / layers * 1e6,
                     "bare_loop_us_per_layer": r["bare_decode_loop"] / layers * 1e6})
    for row in rows:
        print(f"{row['engine']:22s} decode {row['decode_us_per_layer']:6.1f} us/layer  "
              f"mixed {row['mixed_us_per_layer']:6.1f} us/layer  bare loop {row['bare_loop_us_per_layer']:6.1f} us/layer")
    after = rows[-1]
    metrics = {"decode_us_per_layer": after["decode_us_per_layer"], "mixed_us_per_layer": after["mixed_us_per_layer"],
               "bare_loop_us_per_layer": after["bare_loop_us_per_layer"]}
    if len(rows) > 1:
        metrics["decode_us_per_layer_before"] = rows[0]["decode_us_per_layer"]
        metrics["mixed_us_per_layer_before"] = rows[0]["mixed_us_per_layer"]
    md = ("Eager steps of a 32-layer, hidden-64 Qwen2-shaped random model (vocab 4096), CPU, 1 torch thread, "
          f"ragged attention, greedy; median of {args.steps} steps, smallest over {args.rounds} alternating rounds. On this model a step's time is host work. "
          "`bare_loop`: the operator generator alone on prebuilt decode-step tensors.\n\n"
          + markdown_table(rows, ["engine", "decode_step_ms", "decode_us_per_layer", "mixed_step_ms",
                                  "mixed_us_per_layer", "bare_loop_us_per_layer"])
          + "\nOn the CPU the device is the host: the synchronisations and pageable copies a step no longer makes "
          "cost nothing here, so before and after differ only by the step's preparation and sampling (the gap "
          "between a step and the bare loop); the CUDA side is what `gpu_check.py` (b) measures (eager 8B decode). "
          "Figures are measured, not asserted.\n")
    write_result("host_time", metrics, markdown=md, extra={"results": results, "runs": runs, "steps": args.steps,
                                                            "rounds": args.rounds},
                 results_dir=args.results_dir)


if __name__ == "__main__":
    main()
