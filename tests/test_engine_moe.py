"""The MoE models (Qwen3-MoE, Mixtral) against ``transformers``: greedy tokens identical (fp32,
random weights with sharpened projections so no near tie decides) over several expert counts and
top-k, with and without renormalised top-k weights, dense layers among sparse ones
(``decoder_sparse_step``, ``mlp_only_layers``); the CPU sort-by-expert path against the
per-expert loop (uneven loads, idle experts); operator-level preemption and bucket runs on a
sparse model; config errors."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from engine_support import VOCAB, Driver, hf_greedy_at, make_request, prompts
from laneserve.core.kv import KVCacheManager
from laneserve.engine import EngineConfig, EngineExecutor, ModelConfig, UnsupportedModelError, load_model
from laneserve.engine.models.moe import MoEWeights, moe_down, moe_gate_up, reference_moe, sorted_gate_up

_TMP = tempfile.TemporaryDirectory(prefix="laneserve-moe-tests-")

#: name -> (family, options)
VARIANTS = {
    "qwen3moe-e4k2": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen3moe-e8k2-norm": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3moe-e6k3-sparse-step": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                                                    decoder_sparse_step=2, num_hidden_layers=4)),
    "qwen3moe-e8k1-mlp-only": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=1, norm_topk_prob=False,
                                                 mlp_only_layers=[0], num_hidden_layers=3)),
    "mixtral-e4k2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-e8k3": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3)),
}


@functools.cache
def checkpoint(name: str) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    family, opts = VARIANTS[name]
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=VOCAB - 1, bos_token_id=1)
    common.update(opts)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                             rope_theta=1000000.0)
    else:
        cfg = MixtralConfig(**common, intermediate_size=32, rope_theta=1000000.0)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():     # sharper logits than the default init: greedy choices far from ties
        for pname, p in model.named_parameters():
            if "norm" not in pname and p.shape[0] != VOCAB:
                p.mul_(2.5)
    path = Path(_TMP.name) / name
    model.save_pretrained(path)
    return path


def hf_greedy(name: str, prompt: list[int], n: int) -> list[int]:
    return hf_greedy_at(checkpoint(name), prompt, n)


def executor(name: str, **overrides) -> EngineExecutor:
    cfg = EngineConfig(attention="ragged", block_size=8, num_kv_blocks=128, max_num_batched_tokens=256,
                       num_threads=1, **overrides)
    return EngineExecutor(load_model(checkpoint(name)), KVCacheManager(128, 8), cfg)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_tokens_match_transformers(name):
    ps = prompts([7, 19, 3], seed=5)
    reqs = [make_request(i, p, max_tokens=6) for i, p in enumerate(ps)]
    out = Driver(executor(name)).run(reqs, chunk_size=8)
    assert out == [hf_greedy(name, p, 6) for p in ps]


def test_config_reads_sparse_layers(caplog):
    caplog.set_level("WARNING", logger="laneserve.engine.models.loader")
    cfg = load_model(checkpoint("qwen3moe-e6k3-sparse-step")).config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (6, 3, 32)
    assert cfg.moe_layers == (1, 3) and cfg.norm_topk_prob
    model = load_model(checkpoint("qwen3moe-e8k1-mlp-only"))
    assert model.config.moe_layers == (1, 2)
    assert model.layers[0].moe is None and model.layers[0].gate_up.shape == (2 * 96, 64)
    assert model.layers[1].moe.gate_up.shape == (8, 64, 64) and model.layers[1].gate_up is None
    mixtral = load_model(checkpoint("mixtral-e4k2")).config
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and mixtral.num_experts == 4
    assert "unused" not in caplog.text            # every checkpoint tensor was read


def test_bad_moe_config_is_clear():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 5}
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5"):
        ModelConfig.from_dict(raw)
    mixtral = {**raw, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_dict({**mixtral, "sliding_window": 4096})
    dense = ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]})
    assert dense.num_experts == 0 and dense.moe_layers == ()


def _random_moe(experts: int, top_k: int, hidden: int = 32, inter: int = 24, seed: int = 0, renorm: bool = True):
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(experts, hidden, generator=g),
                      gate_up=torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5,
                      down=torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5,
                      top_k=top_k, renormalize=renorm)


@pytest.mark.parametrize("tokens,experts,top_k,renorm", [(1, 4, 2, True), (13, 8, 2, False), (40, 6, 3, True)])
def test_sorted_path_matches_expert_loop(tokens, experts, top_k, renorm):
    moe = _random_moe(experts, top_k, renorm=renorm)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    routed = moe_gate_up(x, moe)
    torch.testing.assert_close(moe_down(routed, moe), reference_moe(x, moe), rtol=1e-5, atol=1e-5)


def uneven_routing(tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Most pairs on expert 0, a few on 1 and 3, none on 2, 4 and 5 (of 6 experts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    ids[:, 1:] = torch.tensor([1, 3])[torch.randint(0, 2, (tokens, top_k - 1), generator=g)]
    ids[::5, 0] = 3
    ids[::5, 1] = 1
    weights = torch.rand(tokens, top_k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def test_sorted_path_with_uneven_loads_and_idle_experts():
    moe = _random_moe(6, 2)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(3))
    weights, ids = uneven_routing(20, 2)
    routed = sorted_gate_up(x, moe, weights, ids)
    assert routed.counts[2] == routed.counts[4] == routed.counts[5] == 0 and routed.counts[0] >= 16
    torch.testing.assert_close(moe_down(routed, moe), reference_moe(x, moe, (weights, ids)), rtol=1e-5, atol=1e-5)


def test_shards_sum_to_the_whole_layer():
    moe = _random_moe(4, 2, inter=24)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    parts = [moe_down(moe_gate_up(x, moe.shard(r, 3)), moe.shard(r, 3)) for r in range(3)]
    torch.testing.assert_close(sum(parts), reference_moe(x, moe), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not divisible"):
        moe.shard(0, 5)


def test_operator_preemption_resumes_to_the_same_tokens():
    name = "qwen3moe-e8k2-norm"
    p = prompts([23], seed=9)[0]
    ex = executor(name)
    driver, req = Driver(ex), make_request(0, p, max_tokens=4)
    calls = {"n": 0}

    def stop_after_seven() -> bool:
        calls["n"] += 1
        return calls["n"] == 7          # inside layer 1: after its gate_up (a sparse operator)

    _, result = driver.step([(req, len(p))], [], preemptible=True, granularity="operator",
                            should_stop=stop_after_seven)
    assert not result.completed
    assert driver.run([req]) == [hf_greedy(name, p, 4)]


def test_bucket_path_gives_the_same_tokens():
    name = "mixtral-e4k2"
    ps = prompts([5, 11], seed=2)
    reqs = [make_request(i, p, max_tokens=5) for i, p in enumerate(ps)]
    ex = executor(name, cuda_graphs=True)
    assert Driver(ex).run(reqs) == [hf_greedy(name, p, 5) for p in ps]
    assert ex.runner.graphs.stats.static_eager > 0
