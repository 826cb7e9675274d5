"""The Triton paged-attention kernel (``engine/triton_attention.py``) run by Triton's interpreter on
CPU tensors (``TRITON_INTERPRET=1``) against an SDPA reference over the gathered context: decode,
prefill chunks over a cached prefix, fresh prompts, GQA groups, odd lengths, several block sizes,
fp32 / bf16 / fp16, and the ``"paged"`` path inside the engine (tokens identical to ``"ragged"``).
Skipped when Triton is not installed."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton compiles anything

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0)")

from engine_support import Driver, make_executor, make_request, prompts  # noqa: E402
from laneserve.engine.triton_attention import paged_attention, paged_meta  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel tests run under TRITON_INTERPRET=1 on CPU", allow_module_level=True)


def _case(q_lens, starts, heads, kv_heads, dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = [s + n for s, n in zip(starts, q_lens)]
    blocks_needed = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()       # scattered, non-monotonic tables
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used:used + n])
        used += n
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, ctx


def _reference(q, k_cache, v_cache, q_lens, starts, tables, block_size):
    out = torch.empty(q.shape, dtype=torch.float32)
    row = 0
    for n, start, table in zip(q_lens, starts, tables):
        ctx = start + n
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k = k_cache[slots].float().transpose(0, 1)[None]
        v = v_cache[slots].float().transpose(0, 1)[None]
        qq = q[row:row + n].float().transpose(0, 1)[None]
        mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)
        out[row:row + n] = o[0].transpose(0, 1)
        row += n
    return out


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}

CASES = [
    # q_lens, starts (cached tokens), heads, kv_heads, dim, block_size
    ([1, 1, 1], [0, 6, 37], 4, 2, 16, 8),                 # decode (one fresh), GQA group 2
    ([1, 1], [12, 70], 8, 1, 32, 16),                     # decode, MQA (group 8)
    ([7, 1, 13], [19, 30, 0], 4, 4, 16, 4),               # chunk over a prefix + decode + fresh prompt, MHA
    ([5, 9], [3, 11], 6, 2, 24, 3),                       # odd block size, odd head_dim (padded to 32), group 3
    ([33], [41], 4, 2, 16, 1),                            # block size 1, a chunk longer than a tile
]


@pytest.mark.parametrize("q_lens, starts, heads, kv_heads, dim, block_size", CASES)
def test_kernel_matches_sdpa_fp32(q_lens, starts, heads, kv_heads, dim, block_size):
    q, k_cache, v_cache, tables, ctx = _case(q_lens, starts, heads, kv_heads, dim, block_size, torch.float32)
    meta = paged_meta(q_lens, ctx, tables, block_size, torch.device("cpu"))
    out = paged_attention(q, k_cache, v_cache, meta, block_size)
    ref = _reference(q, k_cache, v_cache, q_lens, starts, tables, block_size)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_sdpa_half(dtype):
    q_lens, starts = [1, 6, 1], [9, 17, 0]
    q, k_cache, v_cache, tables, ctx = _case(q_lens, starts, 4, 2, 16, 8, dtype, seed=3)
    meta = paged_meta(q_lens, ctx, tables, 8, torch.device("cpu"))
    out = paged_attention(q, k_cache, v_cache, meta, 8)
    assert out.dtype == dtype
    ref = _reference(q, k_cache, v_cache, q_lens, starts, tables, 8)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_small_tiles_cover_long_contexts():
    """Tiles smaller than the chunk and the context: several query tiles per sequence, several key
    tiles per program."""
    q_lens, starts = [11, 1], [21, 40]
    q, k_cache, v_cache, tables, ctx = _case(q_lens, starts, 4, 2, 16, 4, torch.float32, seed=5)
    meta = paged_meta(q_lens, ctx, tables, 4, torch.device("cpu"))
    out = paged_attention(q, k_cache, v_cache, meta, 4, block_m=16, block_n=16)
    ref = _reference(q, k_cache, v_cache, q_lens, starts, tables, 4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_short_block_table_is_rejected():
    with pytest.raises(ValueError):
        paged_meta([4], [20], [[0, 1]], 8, torch.device("cpu"))


def test_engine_paged_path_matches_ragged():
    """The ``"paged"`` path in the engine: a chunk over a cached prefix with a fresh prompt, then
    batched decodes: greedy tokens and logprobs as the ragged gather path gives them."""
    def run(attention):
        ex = make_executor("qwen3", attention)
        driver = Driver(ex)
        reqs = [make_request(i, p, 3, logprobs=2) for i, p in enumerate(prompts([13, 7], seed=6))]
        driver.step([(reqs[0], 6)], [])
        driver.step([(reqs[0], 7), (reqs[1], 7)], [])
        for _ in range(2):
            driver.step([], reqs)
        return [list(r.output_token_ids) for r in reqs], driver.logprobs

    paged_tokens, paged_lp = run("paged")
    ragged_tokens, ragged_lp = run("ragged")
    assert paged_tokens == ragged_tokens
    for rid in ragged_lp:
        for a, b in zip(paged_lp[rid], ragged_lp[rid]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_decode_buckets_on_the_paged_kernel_match_eager():
    """``cuda_graphs`` with the ``"paged"`` path: decode buckets run the Triton kernel on the
    bucket's static block tables (what a captured graph replays; eagerly here) and give the eager
    ragged path's tokens, across bucket sizes and padding rows."""
    from laneserve.core.kv import KVCacheManager
    from laneserve.engine import EngineConfig, EngineExecutor
    from engine_support import _model

    def run(graphs: bool, attention: str):
        cfg = EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1,
                           attention=attention, cuda_graphs=graphs, graph_max_batch=4, graph_max_context=64,
                           graph_max_prefill_len=16, graph_max_prefill_batch=2)
        ex = EngineExecutor(_model("qwen3"), KVCacheManager(64, 8), cfg)
        driver = Driver(ex)
        reqs = [make_request(i, p, 5) for i, p in enumerate(prompts([9, 14, 3], seed=11))]
        driver.step([(r, r.prompt_len) for r in reqs], [])
        for k in range(4):
            driver.step([], reqs[: 3 - k % 2])            # batches of 3 and 2 in a 4-row bucket
        return [list(r.output_token_ids) for r in reqs], ex

    tokens, ex = run(True, "paged")
    stats = ex.runner.graphs.stats
    assert stats.static_eager == 4 and all(key.kind == "decode" for key in stats.runs)
    assert all(ex.runner.graphs._buckets[key].paged is not None for key in stats.runs)
    assert tokens == run(False, "ragged")[0]


def test_start_up_check_of_the_kernel():
    """The check a CUDA runner makes before choosing the paged path (falling back to ragged if it
    fails): passes on a working kernel, fails on a broken one."""
    from engine_support import _model
    from laneserve.engine import triton_attention
    from laneserve.engine.runner import _check_paged_kernel, paged_kernel_works

    model = _model("qwen3")
    assert paged_kernel_works(model) and _check_paged_kernel(model)
    real = triton_attention.paged_attention
    try:
        triton_attention.paged_attention = lambda *a, **k: real(*a, **k) * 2       # wrong results
        assert not _check_paged_kernel(model)
    finally:
        triton_attention.paged_attention = real
