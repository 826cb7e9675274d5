"""Random-weight checkpoints for engine benchmarks (built with ``transformers`` from a config,
saved once into a cache folder; no download)."""

from __future__ import annotations

import os
from pathlib import Path

SHAPES = {
    # Qwen2-shaped, vocab 4096 (docs/design.md, measured facts: a small vocab cuts the fixed LM-head cost on CPU)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    # 32 layers of almost nothing: a step's time is the host's (benchmarks/host_time.py)
    "tiny32": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                   num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
}


def random_checkpoint(shape: str = "small", vocab: int = 4096, max_len: int = 8192) -> Path:
    base = Path(os.environ.get("LANESERVE_CACHE", Path.home() / ".cache" / "laneserve"))
    path = base / f"bench-qwen2-{shape}-v{vocab}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=True,
                      eos_token_id=vocab - 1, bos_token_id=1, **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():                 # sharper logits: greedy choices far from ties
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] != vocab:
                p.mul_(2.5)
    model.save_pretrained(path)
    return path


def model_shape(model) -> dict:
    """The shape of a loaded engine model, for a benchmark's JSON."""
    cfg = model.config
    keys = ("model_type", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
            "head_dim", "vocab_size")
    return {k: getattr(cfg, k) for k in keys} | {"dtype": str(model.dtype).removeprefix("torch.")}


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile, ``q`` in [0, 1]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def greedy_requests(specs, seed: int, vocab: int = 4000) -> list:
    """Engine requests for ``specs``: random prompt token ids (deterministic by ``seed``, drawn in
    spec order) and greedy sampling for exactly the spec's output length (EOS ignored)."""
    import random

    from laneserve.core import Request, SamplingParams
    rng = random.Random(seed)
    reqs = []
    for spec in specs:
        req = Request.from_spec(spec)
        req.prompt_token_ids = [rng.randrange(1, vocab) for _ in range(spec.prompt_len)]
        req.sampling = SamplingParams(max_tokens=req.max_output_tokens, temperature=0, ignore_eos=True)
        reqs.append(req)
    return reqs
