"""Per-step cost of a tensor-parallel instance on CPU (gloo) against one rank, same script, same
tiny checkpoint: decode steps at a fixed batch, timed on rank 0 (the caller's view of
``execute``), split into the step broadcast (``publish`` on the shared-memory channel) and the
collectives (all-reduces and the logits gather), in microseconds per step. Also the size of the
step message at batch 256: the first step (every request new) and a steady decode step (ids and
one new token each).

    python benchmarks/tp_step_cost.py      # writes benchmarks/results/tp_step_cost.{json,md}

On a shared 2-core machine TP4 runs 4 processes on 2 cores: the ratios say what the
communication costs here, not what it costs on a GPU node.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO
from laneserve.engine.config import EngineConfig
from laneserve.engine.executor import EngineExecutor
from laneserve.engine.models.loader import load_model
from laneserve.engine.runner import plan_sequences
from laneserve.engine.tp.executor import TPExecutor
from laneserve.engine.tp.step_message import StepEncoder

OUT = Path(__file__).resolve().parent / "results"
DEGREES = (1, 2, 4)
BATCH, STEPS, WARMUP = 16, 40, 5
MSG_BATCH = 256


def checkpoint(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def request(rid: int, prompt_len: int, steps: int) -> Request:
    req = Request(request_id=rid, arrival_time=0.0, prompt_len=prompt_len, max_output_tokens=steps + 1,
                  slo=SLO(), prompt_token_ids=[(rid * 7 + i) % 2000 + 2 for i in range(prompt_len)])
    req.sampling = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    return req


class Timer:
    """Wraps a method and sums the seconds spent in it."""

    def __init__(self, obj, name: str) -> None:
        self.total = 0.0
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t
        setattr(obj, name, timed)


def measure(path: Path, tp: int) -> dict:
    config = EngineConfig(num_kv_blocks=256, block_size=16, num_threads=1)
    if tp == 1:
        model = load_model(path)
        ex = EngineExecutor(model, KVCacheManager(256, 16), config)
    else:
        ex = TPExecutor.start(path, tp, config)
    try:
        reqs = [request(i, 32, STEPS + WARMUP) for i in range(BATCH)]
        plan = StepPlan()
        for r in reqs:
            ex.kv.allocate(r.request_id, r.prompt_len)
            plan.prefills.append(PrefillChunk(r, 0, r.prompt_len))
        result = ex.execute(plan)
        for r in reqs:
            r.num_computed_tokens = r.prompt_len
            r.record_token(0.0, result.sampled[r.request_id])
        comm = [] if tp == 1 else [Timer(ex.model.comm, "all_reduce"), Timer(ex.model.comm, "gather_logits")]
        publish = None if tp == 1 else Timer(ex.group, "publish")
        times = []
        for step in range(WARMUP + STEPS):
            if step == WARMUP:
                for t in comm + ([publish] if publish else []):
                    t.total = 0.0
            plan = StepPlan(decodes=list(reqs))
            for r in reqs:
                ex.kv.allocate(r.request_id, r.context_len)
            t0 = time.perf_counter()
            result = ex.execute(plan)
            if step >= WARMUP:
                times.append(time.perf_counter() - t0)
            for r in reqs:
                r.num_computed_tokens += 1
                r.record_token(float(step), result.sampled[r.request_id])
        return {"tp": tp, "batch": BATCH, "steps": STEPS, "step_us_median": statistics.median(times) * 1e6,
                "step_us_mean": statistics.fmean(times) * 1e6,
                "broadcast_us_per_step": publish.total / STEPS * 1e6 if publish else 0.0,
                "collectives_us_per_step": sum(t.total for t in comm) / STEPS * 1e6,
                "all_reduces_per_step": 2 * ex.model.config.num_layers + 1 if tp > 1 else 0}
    finally:
        if tp > 1:
            ex.close()


def message_sizes() -> dict:
    """Pickled step message at batch MSG_BATCH: the first step, then a steady decode step."""
    import pickle

    kv = KVCacheManager(4096, 16)
    enc = StepEncoder()
    reqs = [request(i, 200, 8) for i in range(MSG_BATCH)]
    plan = StepPlan()
    for r in reqs:
        kv.allocate(r.request_id, r.prompt_len)
        plan.prefills.append(PrefillChunk(r, 0, r.prompt_len))
    first = len(pickle.dumps(enc.encode(plan, plan_sequences(plan, kv), [], kv, False), protocol=5))
    for r in reqs:
        r.num_computed_tokens = r.prompt_len
        r.record_token(0.0, 5)
    sizes = []
    for step in range(2):       # the second decode crosses no block boundary: no table diff
        plan = StepPlan(decodes=list(reqs))
        for r in reqs:
            kv.allocate(r.request_id, r.context_len)
        sizes.append(len(pickle.dumps(enc.encode(plan, plan_sequences(plan, kv), [], kv, False), protocol=5)))
        for r in reqs:
            r.num_computed_tokens += 1
            r.record_token(1.0 + step, 6)
    return {"batch": MSG_BATCH, "first_step_bytes": first, "decode_step_bytes": sizes[-1],
            "decode_bytes_per_request": sizes[-1] / MSG_BATCH}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp) / "llama")
        rows = [measure(path, tp) for tp in DEGREES]
    base = rows[0]["step_us_median"]
    for r in rows:
        r["step_vs_tp1"] = r["step_us_median"] / base
    sizes = message_sizes()
    OUT.mkdir(exist_ok=True)
    (OUT / "tp_step_cost.json").write_text(json.dumps({"rows": rows, "message": sizes}, indent=1) + "\n")
    lines = ["# tp_step_cost", "", "Command: `python benchmarks/tp_step_cost.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), 1 torch thread per rank, Python "
             f"{platform.python_version()}; CPU, gloo; 4-layer Llama (hidden 256, 8 heads, 4 KV heads), "
             f"decode steps at batch {BATCH}, median of {STEPS}", "",
             "| TP | step (us, median) | vs TP1 | broadcast (us/step) | collectives on rank 0, incl. waiting for the other ranks (us/step) "
             "| all-reduces/step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tp']} | {r['step_us_median']:.0f} | {r['step_vs_tp1']:.2f}x | {r['broadcast_us_per_step']:.0f} "
              f"| {r['collectives_us_per_step']:.0f} | {r['all_reduces_per_step']} |" for r in rows]
    lines += ["", f"Step message at batch {sizes['batch']}: first step (200-token prompts, all new) "
              f"{sizes['first_step_bytes']} B; steady decode step {sizes['decode_step_bytes']} B "
              f"({sizes['decode_bytes_per_request']:.1f} B per request)."]
    (OUT / "tp_step_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
