"""Tiny random checkpoints whose shapes bite tensor parallelism: a vocabulary not divisible by 2
or 4, fewer KV heads than ranks (Llama-3 GQA with 2, Qwen2 MQA with 1), Qwen2 biases and tied
embeddings, Qwen3 q/k norms. The LM head is scaled up so greedy choices and logprobs are far from
ties that a different reduction order could flip (through the final norm's weight, which
scales the logits without touching a tied embedding)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

VOCAB = 509          # prime: no degree divides it
_TMP = tempfile.TemporaryDirectory(prefix="laneserve-tp-tests-")


@functools.cache
def tp_checkpoint(family: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, eos_token_id=VOCAB - 1, bos_token_id=1)
    if family == "llama":      # Llama-3: 8 heads, 2 KV heads (replicated at TP4), llama3 rope scaling
        cfg = LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "qwen2":    # MQA: one KV head; q/k/v biases; tied embeddings
        cfg = Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                          rope_theta=1000000.0)
    elif family == "qwen3":    # q/k norm, head_dim 16 != hidden / heads
        cfg = Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rope_theta=1000000.0)
    elif family == "llama9":   # 9 heads, 3 KV heads: TP3 works, TP2 / TP4 do not
        cfg = LlamaConfig(**{**common, "hidden_size": 72, "intermediate_size": 144},
                          num_attention_heads=9, num_key_value_heads=3)
    else:
        raise ValueError(family)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.shape[0] != VOCAB:
                p.mul_(6.0 if family == "qwen2" else 2.5)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
        model.model.norm.weight.mul_(8.0)     # wide logit margins (the tied embedding is left alone)
    path = Path(_TMP.name) / family
    model.save_pretrained(path)
    return path
