"""Offline throughput: laneserve's engine vs Hugging Face ``generate`` with padded static batches.

The same random-weight small model (Qwen2-shaped, 8 layers, hidden 512, vocab 4096), the same
prompts with ShareGPT first-turn lengths (prompts <= 512 tokens, outputs <= 128, EOS ignored),
greedy. HF runs static batches of HF_BATCH prompts (left-padded, each batch decodes to its longest
output); laneserve runs the offline LLM API (continuous batching). Output tokens/s counts only the
tokens each request asked for. Target: metrics.speedup_vs_hf >= 2.

    python benchmarks/engine_vs_hf.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_models import random_checkpoint  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402
from laneserve.core import SamplingParams  # noqa: E402
from laneserve.engine import EngineConfig  # noqa: E402
from laneserve.engine.llm import LLM  # noqa: E402
from laneserve.workloads import make_workload  # noqa: E402

NUM_PROMPTS, HF_BATCH, THREADS = 128, 16, 2
MAX_PROMPT, MAX_OUTPUT = 512, 128


def workload() -> list[tuple[list[int], int]]:
    wl = make_workload("sharegpt", max_conversations=400, seed=0)
    firsts = [s for s in wl.specs if s.turn == 0][:NUM_PROMPTS]
    rng = random.Random(0)
    return [([rng.randrange(1, 4000) for _ in range(min(s.prompt_len, MAX_PROMPT))], min(s.output_len, MAX_OUTPUT))
            for s in firsts]


def run_hf(path: Path, items) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(items), HF_BATCH):
            batch = items[b:b + HF_BATCH]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, (p, _) in enumerate(batch):          # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(n for _, n in batch),
                                 min_new_tokens=0, eos_token_id=None, pad_token_id=0)
            outs += [gen[i, width:width + n].tolist() for i, (_, n) in enumerate(batch)]
    return time.perf_counter() - t0, outs


def run_laneserve(path: Path, items) -> tuple[float, list[list[int]]]:
    llm = LLM(path, config=EngineConfig(num_threads=THREADS, num_kv_blocks=8192, max_num_batched_tokens=2048),
              quiet=True)
    llm.generate([items[0][0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in items]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in items], params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def main() -> None:
    torch.set_num_threads(THREADS)
    path = random_checkpoint("small")
    items = workload()
    out_tokens = sum(n for _, n in items)
    ls_s, ls_out = run_laneserve(path, items)
    hf_s, hf_out = run_hf(path, items)
    same = sum(a == b for a, b in zip(ls_out, hf_out))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ls_out, hf_out)]
    metrics = {"laneserve_output_tok_s": out_tokens / ls_s, "hf_output_tok_s": out_tokens / hf_s,
               "speedup_vs_hf": hf_s / ls_s, "identical_outputs": same, "num_prompts": len(items),
               "identical_fraction": same / len(items),
               "mean_matching_prefix_fraction": sum(p / len(a) for p, a in zip(prefix, ls_out)) / len(items)}
    rows = [{"system": "laneserve (continuous batching)", "seconds": ls_s, "output_tok_s": out_tokens / ls_s},
            {"system": f"HF generate (static batches of {HF_BATCH}, left-padded)", "seconds": hf_s,
             "output_tok_s": out_tokens / hf_s}]
    for k, v in metrics.items():
        print(f"{k:30s} {v:.4g}")
    write_result("engine_vs_hf", metrics, markdown=markdown_table(rows),
                 extra={"model": "Qwen2-shaped 8 layers, hidden 512, vocab 4096, random weights (x2.5)",
                        "threads": THREADS, "output_tokens": out_tokens,
                        "prompt_tokens": sum(len(p) for p, _ in items)})


if __name__ == "__main__":
    main()
