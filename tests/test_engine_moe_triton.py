"""The Triton grouped expert GEMM (``engine/moe_triton.py``) run by Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``) against the per-expert loop: fp32 / bf16 / fp16, uneven expert
loads, experts with no tokens, shapes that are not multiples of the tiles, one token (decode).
Skipped when Triton is not installed."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton compiles anything

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0)")

from laneserve.engine.models.moe import MoEWeights, reference_moe, route  # noqa: E402
from laneserve.engine.moe_triton import block_plan, fused_down, fused_gate_up  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel tests run under TRITON_INTERPRET=1 on CPU", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _moe(experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(experts, hidden, generator=g).to(dtype),
                      gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype),
                      down=(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype),
                      top_k=top_k, renormalize=True)


def _uneven(tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of 6 experts: most pairs on expert 0, some on 1 and 3, none on 2, 4, 5."""
    g = torch.Generator().manual_seed(7)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    ids[:, 1] = torch.tensor([1, 3])[torch.randint(0, 2, (tokens,), generator=g)]
    ids[::5, 0] = 3
    ids[::5, 1] = 1
    weights = torch.rand(tokens, top_k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def test_block_plan_pads_each_expert_to_whole_blocks():
    _, ids = _uneven(21, 2)
    plan = block_plan(ids, 6, block_m=16)
    counts = torch.bincount(ids.flatten(), minlength=6).tolist()
    used = [e for e in plan.block_expert.tolist() if e >= 0]
    assert used == sorted(used) and set(used) == {e for e, c in enumerate(counts) if c}
    for e, c in enumerate(counts):
        assert used.count(e) == -(-c // 16)
    pairs = plan.sorted_pairs.view(-1, 16)
    for row, e in zip(pairs, plan.block_expert.tolist()):
        real = row[row < plan.num_pairs]
        assert e >= 0 or real.numel() == 0
        assert all(ids.flatten()[p] == e for p in real.tolist())
    assert sorted(plan.sorted_pairs[plan.sorted_pairs < plan.num_pairs].tolist()) == list(range(42))


@pytest.mark.parametrize("dtype,block_m", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float16, 16),
                                           (torch.float32, 64)])
def test_fused_moe_matches_expert_loop_with_uneven_loads(dtype, block_m):
    moe = _moe(6, 2, hidden=48, inter=40, dtype=dtype)
    x = torch.randn(21, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = _uneven(21, 2)
    weights = weights.to(dtype)
    routed = fused_gate_up(x, moe, weights, ids, block_m=block_m)
    got = fused_down(routed, moe)
    want = reference_moe(x.float(), _as_float(moe), (weights.float(), ids))
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_fused_moe_routed_decode_token():
    moe = _moe(8, 3, hidden=32, inter=16, dtype=torch.float32, seed=2)
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = route(x, moe)
    got = fused_down(fused_gate_up(x, moe, weights, ids), moe)
    torch.testing.assert_close(got, reference_moe(x, moe), rtol=1e-5, atol=1e-5)


def test_engine_on_the_fused_path_matches_transformers(monkeypatch):
    """The whole model with every sparse layer on the Triton path (forced on CPU tensors)."""
    import laneserve.engine.models.moe as moe_module
    from engine_support import Driver, make_request, prompts
    from test_engine_moe import executor, hf_greedy

    monkeypatch.setattr(moe_module, "_use_triton", lambda x: True)
    name = "qwen3moe-e8k2-norm"
    ps = prompts([9, 4], seed=3)
    reqs = [make_request(i, p, max_tokens=3) for i, p in enumerate(ps)]
    ex = executor(name)
    calls = []
    real = moe_module.Routed
    monkeypatch.setattr("laneserve.engine.moe_triton.Routed", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert Driver(ex).run(reqs) == [hf_greedy(name, p, 3) for p in ps]
    assert len(calls) == 2 * 3            # 2 sparse layers x (1 prefill step + 2 decode steps)


def _as_float(moe: MoEWeights) -> MoEWeights:
    return MoEWeights(moe.router.float(), moe.gate_up.float(), moe.down.float(), moe.top_k, moe.renormalize)
