"""The engine driven by the real schedulers: the offline LLM API, the in-process PD cluster, the
profiler, and greedy tokens that do not depend on the scheduling policy."""

import random

import pytest

from engine_support import hf_greedy, prompts, tiny_checkpoint
from laneserve.cluster import LocalCluster
from laneserve.core import SLO, Request, SamplingParams
from laneserve.costmodel.fitted import FittedCostModel
from laneserve.engine import EngineConfig, EngineExecutor
from laneserve.engine.llm import LLM
from laneserve.engine.profiler import QUICK, EngineProfiler

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint("qwen2"), config=EngineConfig(num_kv_blocks=512, max_num_batched_tokens=64),
               quiet=True)


def test_llm_generate_matches_hf_with_chunked_colocated_scheduling(llm):
    ps = prompts([5, 40, 17, 90, 3], seed=3)
    outs = llm.generate(ps, [SamplingParams(max_tokens=n, **GREEDY) for n in (6, 9, 4, 12, 7)])
    assert [o.finish_reason for o in outs] == ["length"] * 5
    for p, o, n in zip(ps, outs, (6, 9, 4, 12, 7)):
        assert o.token_ids == hf_greedy("qwen2", p, n)
        assert o.metrics["ttft"] > 0 and o.metrics["e2e"] >= o.metrics["ttft"]


def test_llm_rejects_bad_input_before_running_anything(llm):
    free = llm.executor.kv.num_free_blocks
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[1, 2, 3], [1] * 600], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[1], [2]], [SamplingParams()])
    assert llm.executor.kv.num_free_blocks == free and llm.instance.idle


def _record_prefill_chunks(llm) -> list[tuple[int, int, int]]:
    """``(request id, start, new tokens)`` of every prefill chunk ``llm``'s executor runs."""
    chunks: list[tuple[int, int, int]] = []
    execute = llm.executor.execute

    def recording(plan, *args, **kwargs):
        chunks.extend((c.request.request_id, c.start, c.num_new_tokens) for c in plan.prefills)
        return execute(plan, *args, **kwargs)

    llm.executor.execute = recording
    return chunks


def test_scheduling_policy_does_not_change_greedy_tokens():
    ps = prompts([33, 7, 64, 12], seed=9)
    ref = [hf_greedy("llama", p, 8) for p in ps]
    chunks = {}
    # a step budget of 16 tokens chunks every prompt longer than that (the colocated step's budget,
    # not cp-edf's own ``chunk``, bounds a colocated prefill chunk)
    for policy in ("colocated:prefill=fcfs", "colocated:prefill=cp-edf,token_budget=16"):
        llm = LLM(tiny_checkpoint("llama"), config=EngineConfig(num_kv_blocks=256), policy=policy, quiet=True)
        chunks[policy] = _record_prefill_chunks(llm)
        assert [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=8, **GREEDY))] == ref
    # the schedules really differ: FCFS prefilled each prompt whole, chunked prefill split the long ones
    assert sorted(n for _, start, n in chunks["colocated:prefill=fcfs"] if start == 0) == [7, 12, 33, 64]
    chunked = chunks["colocated:prefill=cp-edf,token_budget=16"]
    assert max(n for *_, n in chunked) <= 16
    assert {rid for rid, start, _ in chunked if start > 0} == {0, 2}      # the 33- and 64-token prompts


def test_decode_memory_pressure_recompute_keeps_tokens():
    """A KV cache too small for every request forces recompute preemption in the colocated
    decode; outputs must still equal the unpressured run."""
    ps = prompts([30, 30, 30, 30], seed=5)
    ref = [hf_greedy("qwen2", p, 20) for p in ps]
    llm = LLM(tiny_checkpoint("qwen2"), config=EngineConfig(num_kv_blocks=12, block_size=8), quiet=True)
    outs = llm.generate(ps, SamplingParams(max_tokens=20, **GREEDY))
    assert llm.instance.scheduler.decode.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref


def test_local_pd_cluster_matches_single_engine():
    path = tiny_checkpoint("qwen3")
    rng = random.Random(0)
    ps = prompts([12, 50, 3, 70, 25, 9], seed=2)
    reqs = [Request(i, 0.01 * i, len(p), 6, SLO(), prompt_token_ids=list(p),
                    sampling=SamplingParams(max_tokens=6, **GREEDY)) for i, p in enumerate(ps)]
    rng.shuffle(reqs)
    cluster = LocalCluster(path, num_prefill=1, num_decode=2, config=EngineConfig(num_threads=1), kv_tokens=4096)
    done = cluster.run(reqs, timeout=120)
    assert sorted(r.request_id for r in done) == list(range(len(ps)))
    for r in done:
        assert r.output_token_ids == hf_greedy("qwen3", ps[r.request_id], 6)
        assert r.times.transfer_start <= r.times.transfer_end <= r.times.finished
    for inst in (*cluster.prefill, *cluster.decode):
        assert inst.scheduler.kv.num_free_blocks == inst.scheduler.kv.num_blocks
    # the default deployment: adaptive both sides, decode placed by the tpot-aware router, which
    # read the decode instances' summaries across threads and learned from their steps
    assert cluster.deployment.decode_router_name() == "tpot-aware"
    router = cluster.runtime.decode_router
    assert router.name == "tpot-aware" and router.learner.observations > 0
    assert {r.decode_instance for r in done} <= {inst.instance_id for inst in cluster.decode}


def test_profile_feeds_a_fitted_cost_model():
    ex = EngineExecutor.from_pretrained(tiny_checkpoint("llama"), EngineConfig(num_kv_blocks=256))
    grid = dict(QUICK, prefill_lens=(16, 64, 256), cached=(0, 128), decode_batches=(1, 4), decode_ctx=(32, 256),
                prefill_batches=((4, 32),))
    prof = EngineProfiler(ex, repeats=1).run(grid, model_name="tiny", device="cpu")
    assert len(prof.prefill) >= 6 and len(prof.decode) >= 4 and len(prof.op_fractions) == 5
    model = FittedCostModel(prof)
    assert model.prefill_time([(256, 0)]) > 0 and model.decode_step_time([32] * 4) > 0
    assert ex.kv.num_free_blocks == ex.kv.num_blocks          # profiling leaves no blocks behind
