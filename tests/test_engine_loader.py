"""Checkpoint loading: transformers 4.x / 5.x config layouts, clear errors, sharded safetensors,
bf16, the offline smoke model."""

from __future__ import annotations

import json

import pytest
import torch

from engine_support import Driver, _model, hf_greedy, make_request, prompts, tiny_checkpoint
from laneserve.core.kv import KVCacheManager
from laneserve.engine import EngineConfig, EngineExecutor, ModelConfig, UnsupportedModelError, load_model
from laneserve.engine.models.rope import inverse_frequencies

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4}


def test_rope_theta_read_from_both_layouts():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **llama3}})
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **llama3}})
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_scaling == v5.rope_scaling and v4.rope_scaling["rope_type"] == "llama3"
    assert torch.equal(inverse_frequencies(v4)[0], inverse_frequencies(v5)[0])
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.num_kv_heads == 4 and plain.head_dim == 8


def test_unsupported_architectures_and_options_are_clear():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})
    with pytest.raises(UnsupportedModelError, match="rope type"):
        inverse_frequencies(ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    from engine_support import hf_model

    hf_model("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path)
    ref = _model("llama")
    assert torch.equal(model.layers[1].qkv, ref.layers[1].qkv) and torch.equal(model.lm_head, ref.lm_head)


def test_bfloat16_runs():
    p = prompts([10], seed=1)[0]
    model = load_model(tiny_checkpoint("qwen3"), dtype="bfloat16")
    ex = EngineExecutor(model, KVCacheManager(64, 8), EngineConfig(dtype="bfloat16", block_size=8, num_kv_blocks=64))
    out = Driver(ex).run([make_request(0, p, 4)])[0]
    assert len(out) == 4 and ex.runner.cache.data.dtype == torch.bfloat16
    assert out[0] == hf_greedy("qwen3", p, 1)[0]


def test_smoke_model_is_built_offline_and_labelled(tmp_path, monkeypatch):
    from laneserve.engine.smoke import SMOKE_VERSION, is_smoke_model, smoke_model_path

    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path))
    path = smoke_model_path()
    assert path == tmp_path / f"v{SMOKE_VERSION}" / "smoke-llama" and is_smoke_model(path) and "noise" in (path / "README.md").read_text()
    assert smoke_model_path() == path   # cached
    ex = EngineExecutor.from_pretrained(path, EngineConfig(num_kv_blocks=32))
    tok = ex.model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hello how are you ?"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tok.decode(ids) == "<|user|> hello how are you ? <|end|> <|assistant|> "   # byte-level: exact text
    req = make_request(0, ids, 5)
    out = Driver(ex).run([req])[0]
    assert len(out) == 5 and isinstance(tok.decode(out), str)


def test_engine_config_derives_kv_blocks_and_validates():
    assert EngineConfig(num_kv_blocks=7).resolve_num_kv_blocks(1024) == 7
    cfg = EngineConfig(kv_memory_fraction=0.5, block_size=16)
    assert cfg.resolve_num_kv_blocks(1024, free_bytes=1 << 20) == (1 << 19) // (1024 * 16)
    with pytest.raises(ValueError):
        EngineConfig(dtype="float16")          # CUDA only
    with pytest.raises(ValueError):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="attention path"):
        EngineExecutor(_model("llama"), KVCacheManager(8, 16), EngineConfig(attention="flash", num_kv_blocks=8))
