"""The MoE models under tensor parallelism (gloo, CPU): Qwen3-MoE and Mixtral sharded over two rank
processes answer as the same checkpoint on one rank — greedy tokens identical, step and prompt
logprobs within 1e-4, preempted plans resumed to the same tokens — with each expert's intermediate
dimension split across the ranks and the router replicated. The checkpoints cover top-k weights
with and without renormalisation and dense layers among the sparse ones (``mlp_only_layers``,
``decoder_sparse_step``); the vocabulary (509) is not divisible by the degree. One rank group per
model, shared by its tests; the loader and degree checks run in this process without ranks."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch
from engine_support import prompts
from laneserve.core.sampling import SamplingParams
from laneserve.engine.config import EngineConfig
from laneserve.engine.llm import LLM
from laneserve.engine.models.config import ModelConfig
from laneserve.engine.models.loader import load_model
from laneserve.engine.models.moe import moe_down, moe_gate_up
from laneserve.engine.tp.layout import TensorParallelError, check_degree
from laneserve.engine.tp.loader import load_shard
from test_engine_tp import _close, _drive
from tp_support import VOCAB

_TMP = tempfile.TemporaryDirectory(prefix="laneserve-tp-moe-tests-")
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, eos_token_id=VOCAB - 1, bos_token_id=1, rope_theta=1000000.0)

#: name -> (family, options); "qwen3moe": layers 0, 1 sparse, layer 2 dense (mlp_only_layers), top-k
#: weights as the softmax gives them; "qwen3moe-norm": layer 0 dense, layer 1 sparse
#: (decoder_sparse_step=2), top-k weights renormalised; Mixtral: every layer sparse
MODELS = {
    "qwen3moe": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=2,
                                   norm_topk_prob=False, mlp_only_layers=[2])),
    "qwen3moe-norm": ("qwen3_moe", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                                        norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
}


@functools.cache
def moe_checkpoint(name: str) -> Path:
    """A tiny random checkpoint with sharpened projections and a scaled final norm (wide logit
    margins, decisive routing), so a different reduction order cannot flip a near tie."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    family, opts = MODELS[name]
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**_COMMON, **opts, intermediate_size=96, moe_intermediate_size=40, head_dim=16)
    else:
        cfg = MixtralConfig(**_COMMON, **opts, intermediate_size=48)
    torch.manual_seed(2468)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" not in pname and p.shape[0] != VOCAB:
                p.mul_(2.5)
        model.model.norm.weight.mul_(8.0)
    path = Path(_TMP.name) / name
    model.save_pretrained(path)
    return path


def _config() -> EngineConfig:
    # a small token budget: long prompts go in chunks, mixed with other requests' decodes
    return EngineConfig(num_kv_blocks=96, block_size=8, max_num_batched_tokens=24, num_threads=1)


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    ps = [[min(t, VOCAB - 2) for t in p] for p in prompts([5, 41, 12, 3, 27], seed=9)]
    return ps, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) for _ in ps]


_REFERENCE: dict[str, tuple] = {}


def _reference(name: str):
    """The one-rank LLM and its greedy outputs on the workload."""
    if name not in _REFERENCE:
        llm = LLM(moe_checkpoint(name), config=_config(), quiet=True)
        _REFERENCE[name] = (llm, llm.generate(*_workload()))
    return _REFERENCE[name]


@pytest.fixture(scope="module", params=sorted(MODELS))
def group(request):
    llm = LLM(moe_checkpoint(request.param), config=_config(), quiet=True, tensor_parallel_size=2)
    yield request.param, llm
    llm.close()


def test_greedy_tokens_match_one_rank(group):
    name, llm = group
    assert llm.executor.tensor_parallel_size == 2
    sparse = [w.moe for w in llm.model.layers if w.moe is not None]
    cfg = ModelConfig.from_folder(moe_checkpoint(name))
    assert len(sparse) == len(cfg.moe_layers) > 0
    assert all(m.intermediate == cfg.moe_intermediate_size // 2 for m in sparse)   # rank 0 holds half
    _, ref = _reference(name)
    outs = llm.generate(*_workload())
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
    assert any(len(set(o.token_ids)) > 2 for o in outs)          # not a degenerate echo


def test_logprobs_and_preempted_plans_match_one_rank(group):
    """Step and prompt logprobs within 1e-4 of one rank; a plan stopped at every second operator
    boundary (sparse layers' ``gate_up`` and ``down`` among them) resumes to the same tokens."""
    name, llm = group
    ref_llm, _ = _reference(name)
    ref_tokens, ref_lp, ref_prompt_lp, _ = _drive(ref_llm.executor, 1000)
    tokens, lp, prompt_lp, parks = _drive(llm.executor, 1000, stop_every=2)
    assert parks >= 2
    assert tokens == ref_tokens
    _close(ref_lp, lp)
    _close(ref_prompt_lp, prompt_lp)
    assert not llm.executor.parked_plan_ids


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_each_rank_reads_its_slice_of_every_expert(name):
    """The ranks' partial sums of a sparse layer add up to the whole layer; each rank reads its
    rows / columns of each expert, so the ranks together read the checkpoint once plus the copies
    of what every rank holds whole (norms, routers)."""
    path = moe_checkpoint(name)
    cfg = ModelConfig.from_folder(path)
    whole = load_model(path, load_tokenizer_too=False)
    shards = [load_shard(path, r, 2) for r in range(2)]
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for i in cfg.moe_layers:
        full = whole.layers[i].moe
        parts = [s.layers[i].moe for s in shards]
        for r, part in enumerate(parts):
            expected = full.shard(r, 2)
            assert torch.equal(part.gate_up, expected.gate_up) and torch.equal(part.down, expected.down)
            assert torch.equal(part.router, full.router)
        summed = sum(moe_down(moe_gate_up(x, p), p) for p in parts)
        torch.testing.assert_close(summed, moe_down(moe_gate_up(x, full), full), rtol=1e-5, atol=1e-5)
    for i in set(range(cfg.num_layers)) - set(cfg.moe_layers):
        assert all(s.layers[i].moe is None and s.layers[i].gate_up.shape[0] == cfg.intermediate_size
                   for s in shards)
    one = load_shard(path, 0, 1).elements_read
    norms = cfg.hidden_size * (2 * cfg.num_layers + 1) + (2 * cfg.head_dim * cfg.num_layers if cfg.qk_norm else 0)
    routers = len(cfg.moe_layers) * cfg.num_experts * cfg.hidden_size
    assert sum(s.elements_read for s in shards) == one + norms + routers


def test_degrees_the_experts_cannot_take_are_refused_with_the_numbers():
    qwen = ModelConfig.from_folder(moe_checkpoint("qwen3moe"))        # experts of 40, dense MLP of 96
    check_degree(qwen, 2)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=4 .*expert intermediate size 42"):
        check_degree(dataclasses.replace(qwen, moe_intermediate_size=42), 4)
    with pytest.raises(TensorParallelError, match=r"MLP intermediate size 90 is not"):
        check_degree(dataclasses.replace(qwen, intermediate_size=90), 4)
    # no dense layer: the dense MLP size is not a constraint
    check_degree(dataclasses.replace(qwen, intermediate_size=90, moe_layers=(0, 1, 2)), 4)
