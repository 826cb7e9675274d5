"""OPT (``OPTForCausalLM``) against ``transformers``: greedy tokens identical (fp32, random
weights, random LayerNorm affines and biases so every parameter matters, a sharpened LM head so no
near tie decides) for pre- and post-LayerNorm, with and without the ``word_embed_proj_dim``
projection, untied/bias-free/GELU options; chunked prefill with batched decodes; operator-level
preemption and the shape-bucket path; bare ``decoder.*`` checkpoint keys; config errors;
tensor parallelism at TP2/TP4 (ranks as threads) and each rank's shard."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from engine_support import VOCAB, Driver, hf_greedy_at, hf_model_at, make_request, prompts
from laneserve.core.kv import KVCacheManager
from laneserve.engine import EngineConfig, EngineExecutor, ModelConfig, UnsupportedModelError, load_model
from laneserve.engine.models.opt import OPTModel
from laneserve.engine.tp.layout import TensorParallelError, check_degree

_TMP = tempfile.TemporaryDirectory(prefix="laneserve-opt-tests-")

#: name -> OPTConfig options beyond the common ones
VARIANTS = {
    "pre-ln": dict(do_layer_norm_before=True),
    "pre-ln-proj": dict(do_layer_norm_before=True, word_embed_proj_dim=32),
    "post-ln": dict(do_layer_norm_before=False),
    "post-ln-proj": dict(do_layer_norm_before=False, word_embed_proj_dim=32),      # the OPT-350m layout
    "untied-gelu-nobias-noaffine": dict(tie_word_embeddings=False, activation_function="gelu", enable_bias=False,
                                        layer_norm_elementwise_affine=False, word_embed_proj_dim=48),
}


@functools.cache
def checkpoint(name: str) -> Path:
    """A 2-layer random OPT; every parameter redrawn at a scale where it changes the output."""
    from transformers import AutoModelForCausalLM, OPTConfig

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=256, eos_token_id=VOCAB - 1, bos_token_id=1, pad_token_id=1,
                    **VARIANTS[name])
    torch.manual_seed(2024)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "layer_norm" in pname:
                p.copy_(1.0 + 0.2 * noise if pname.endswith("weight") else 0.2 * noise)
            elif pname.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed" in pname or "lm_head" in pname:
                p.copy_(noise)                           # unit-scale tokens and positions: a sharp LM head
            else:
                p.copy_(2.0 * noise / p.shape[1] ** 0.5)
    path = Path(_TMP.name) / name
    model.save_pretrained(path)
    return path


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy_at(checkpoint(name), list(prompt), n)


def executor(name: str, path: Path | None = None, **overrides) -> EngineExecutor:
    cfg = EngineConfig(attention="ragged", block_size=8, num_kv_blocks=128, max_num_batched_tokens=256,
                       num_threads=1, **overrides)
    return EngineExecutor(load_model(path or checkpoint(name)), KVCacheManager(128, 8), cfg)


PROMPTS = prompts([7, 19, 3], seed=5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_tokens_match_transformers(name):
    # three prompts prefilled together in chunks of 8 tokens, then decoded as one batch
    reqs = [make_request(i, p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    out = Driver(executor(name)).run(reqs, chunk_size=8)
    assert out == [hf_greedy(name, tuple(p), 6) for p in PROMPTS]


def test_prefill_chunks_share_steps_with_decodes():
    """Rows of one step at unrelated positions: a request's decodes ride along the chunks of another's prefill."""
    name = "pre-ln-proj"
    a, b = PROMPTS[1], PROMPTS[0]
    ra, rb = make_request(0, a, max_tokens=5), make_request(1, b, max_tokens=5)
    driver = Driver(executor(name))
    driver.step([(ra, len(a))], [])
    driver.step([(rb, 4)], [ra])
    driver.step([(rb, len(b) - 4)], [ra])
    assert driver.run([ra, rb]) == [hf_greedy(name, tuple(a), 5), hf_greedy(name, tuple(b), 5)]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_reference_is_far_from_ties(name):
    """The fixture's point: every greedy choice the tests compare wins by far more than fp32
    rounding (~1e-5 here)."""
    model = hf_model_at(checkpoint(name))
    for p in PROMPTS:
        seq = p + hf_greedy(name, tuple(p), 6)
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, len(p) - 1:-1]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_config_and_weights_are_read():
    cfg = ModelConfig.from_folder(checkpoint("post-ln-proj"))
    assert cfg.architecture == "OPTForCausalLM" and cfg.opt is not None
    assert (cfg.opt.pre_norm, cfg.opt.embed_dim, cfg.opt.final_norm, cfg.opt.position_offset) == (False, 32, False, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 4, 16, 128)
    assert cfg.max_position_embeddings == 256 and cfg.qkv_bias and cfg.tie_word_embeddings
    model = load_model(checkpoint("untied-gelu-nobias-noaffine"))
    assert isinstance(model, OPTModel) and model.config.opt.activation == "gelu"
    assert model.lm_head.data_ptr() != model.embed.data_ptr() and model.emb.project_in.shape == (64, 48)
    assert model.layers[0].qkv_bias is None and model.layers[0].attn_norm == (None, None)
    assert model.emb.final_norm == (None, None)          # pre-LN: a final LayerNorm without affine
    tied = load_model(checkpoint("pre-ln"))
    assert tied.lm_head is tied.embed and tied.emb.project_in is None and tied.emb.final_norm[0] is not None


def test_every_checkpoint_tensor_is_used(caplog):
    caplog.set_level("WARNING", logger="laneserve.engine.models.loader")
    for name in VARIANTS:
        load_model(checkpoint(name))
    assert "unused" not in caplog.text


def test_bare_decoder_keys_load_the_same_model(tmp_path):
    """Checkpoints saved from ``OPTModel`` name tensors ``decoder.*`` (no ``model.`` prefix)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoint("pre-ln-proj")
    state = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    reqs = [make_request(0, PROMPTS[0], max_tokens=4)]
    assert Driver(executor("pre-ln-proj", tmp_path)).run(reqs) == [hf_greedy("pre-ln-proj", tuple(PROMPTS[0]), 4)]


def test_operator_preemption_resumes_to_the_same_tokens():
    name = "post-ln-proj"
    p = PROMPTS[1]
    driver, req = Driver(executor(name)), make_request(0, p, max_tokens=4)
    calls = {"n": 0}

    def stop_after_seven() -> bool:
        calls["n"] += 1
        return calls["n"] == 7          # inside layer 1, after its qkv_proj and attention

    _, result = driver.step([(req, len(p))], [], preemptible=True, granularity="operator",
                            should_stop=stop_after_seven)
    assert not result.completed and calls["n"] == 7
    assert driver.run([req]) == [hf_greedy(name, tuple(p), 4)]


def test_bucket_path_gives_the_same_tokens():
    name = "pre-ln-proj"
    reqs = [make_request(i, p, max_tokens=5) for i, p in enumerate(PROMPTS[:2])]
    ex = executor(name, cuda_graphs=True)
    assert Driver(ex).run(reqs) == [hf_greedy(name, tuple(p), 5) for p in PROMPTS[:2]]
    assert ex.runner.graphs.stats.static_eager > 0


def _raw(**overrides) -> dict:
    raw = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 100, "hidden_size": 32,
           "ffn_dim": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    return {**raw, **overrides}


def test_bad_opt_config_is_clear():
    with pytest.raises(UnsupportedModelError, match="activation_function 'silu'"):
        ModelConfig.from_dict(_raw(activation_function="silu"))
    with pytest.raises(UnsupportedModelError, match="not divisible"):
        ModelConfig.from_dict(_raw(num_attention_heads=5))
    cfg = ModelConfig.from_dict(_raw(_remove_final_layer_norm=True))
    assert cfg.opt.pre_norm and not cfg.opt.final_norm and cfg.opt.embed_dim == 32


@pytest.mark.parametrize("name,tp", [("post-ln-proj", 2), ("untied-gelu-nobias-noaffine", 2), ("pre-ln", 4)])
def test_tensor_parallel_matches_transformers(name, tp):
    """Ranks 1.. as threads of this process (the same rank loop, gloo); chunked prefill with
    batched decodes, as on one rank."""
    from laneserve.engine.tp.executor import TPExecutor

    cfg = EngineConfig(num_kv_blocks=96, block_size=8, max_num_batched_tokens=24, num_threads=1)
    ex = TPExecutor.start(checkpoint(name), tp, cfg, launch="thread")
    try:
        reqs = [make_request(i, p, max_tokens=6) for i, p in enumerate(PROMPTS)]
        assert Driver(ex).run(reqs, chunk_size=8) == [hf_greedy(name, tuple(p), 6) for p in PROMPTS]
    finally:
        ex.close()


def test_a_rank_reads_only_its_shard_and_bad_degrees_are_refused():
    from laneserve.engine.tp.loader import load_shard

    from safetensors.torch import load_file

    path = checkpoint("post-ln-proj")
    state = load_file(str(path / "model.safetensors"))
    total = sum(t.numel() for t in state.values())
    split = sum(t.numel() for k, t in state.items() if k.endswith(("proj.weight", "fc1.weight", "fc2.weight",
                                                                     "embed_tokens.weight"))
                and "project" not in k)
    shard = load_shard(path, 1, 2)
    assert isinstance(shard, OPTModel) and shard.comm is None and shard.vocab_start == VOCAB // 2
    assert shard.config.num_heads == 2 and shard.layers[0].o_bias is None and shard.layers[0].fc2_bias is None
    assert shard.layers[0].qkv.shape == (3 * 32, 64) and shard.layers[0].fc1.shape == (64, 64)
    assert shard.elements_read <= total - split // 2          # half of every split matrix left unread
    with pytest.raises(TensorParallelError, match="4 attention heads are not divisible"):
        check_degree(ModelConfig.from_folder(path), 3)
