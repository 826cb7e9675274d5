"""Prefix caching in the engine: a request starts on the cached blocks of its leading
tokens and computes only the rest; greedy tokens equal Hugging Face's with and without caching —
shared prefixes, partial blocks, output blocks reused by the next chat turn, eviction under memory
pressure, recompute of a preempted request whose prefix is shared, and the PD cluster."""

from __future__ import annotations

import pytest

from engine_support import hf_greedy, prompts, tiny_checkpoint
from laneserve.cluster import LocalCluster
from laneserve.core import SLO, Request, SamplingParams
from laneserve.core.kv import KVCacheManager
from laneserve.engine import EngineConfig
from laneserve.engine.instance import EngineInstance
from laneserve.engine.llm import LLM
from laneserve.policies.registry import make

FAMILY = "qwen2"
GREEDY = dict(temperature=0, ignore_eos=True)
BS = 8


def _llm(blocks: int, caching: bool = True, policy: str = "colocated:prefill=fcfs") -> LLM:
    return LLM(tiny_checkpoint(FAMILY), config=EngineConfig(num_kv_blocks=blocks, block_size=BS, num_threads=1,
                                                            prefix_caching=caching), policy=policy, quiet=True)


def _run(llm: LLM, ps: list[list[int]], max_tokens: int) -> list[Request]:
    """Generate for every prompt at once through the LLM's instance; returns the requests."""
    reqs = [llm._make_request(list(p), SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in ps]
    for req in reqs:
        llm.instance.submit(req)
    llm.instance.run_until_idle()
    return reqs


def _tokens(reqs: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("policy", ["colocated:prefill=fcfs", "colocated:prefill=cp-edf,chunk=16"])
def test_shared_prefixes_and_partial_blocks_match_hf(policy):
    system = prompts([27], seed=21)[0]                  # 3 full blocks + a partial one
    tails = prompts([5, 13, 1], seed=22)
    first = system + tails[0]                          # 32 tokens: block-aligned
    later = [system + tails[1], system + tails[2], first]
    ref_first, ref_later = hf_greedy(FAMILY, first, 6), [hf_greedy(FAMILY, p, 6) for p in later]
    for caching in (False, True):
        llm = _llm(64, caching, policy)
        assert _tokens(_run(llm, [first], 6)) == [ref_first]
        reqs = _run(llm, later, 6)
        assert _tokens(reqs) == ref_later
        # the system prompt's 3 full blocks; a fully cached prompt recomputes its last block
        assert [r.num_cached_tokens for r in reqs] == ([24, 24, 24] if caching else [0, 0, 0])
        kv = llm.executor.kv
        assert kv.num_free_blocks == kv.num_blocks and not kv.tables
        kv.allocator.check()
    assert kv.hit_tokens == 72 and kv.query_tokens == 32 + sum(map(len, later))


def test_next_chat_turn_reuses_the_reply_blocks():
    """Colocated decode names the blocks its outputs fill: turn 2 (turn 1's prompt + reply + a new
    message) finds prompt and reply cached."""
    turn1 = prompts([32], seed=23)[0]
    llm = _llm(64)
    reply = _run(llm, [turn1], 12)[0].output_token_ids   # 32 + 11 computed tokens: 5 full blocks
    turn2 = turn1 + reply + prompts([6], seed=24)[0]
    (req,) = _run(llm, [turn2], 5)
    assert req.output_token_ids == hf_greedy(FAMILY, turn2, 5) and req.num_cached_tokens == 40


def test_eviction_under_memory_pressure_keeps_tokens():
    a, other = prompts([40, 70], seed=25)
    again = a + prompts([3], seed=26)[0]
    llm = _llm(12)                                     # 96 token slots
    assert _tokens(_run(llm, [a], 4)) == [hf_greedy(FAMILY, a, 4)]
    kv = llm.executor.kv
    assert kv.allocator.num_cached == 5
    assert _tokens(_run(llm, [other], 4)) == [hf_greedy(FAMILY, other, 4)]   # 10 blocks: evicts a's
    assert kv.allocator.evicted > 0
    (req,) = _run(llm, [again], 4)
    assert req.output_token_ids == hf_greedy(FAMILY, again, 4)
    assert 0 < req.num_cached_tokens < 40              # a's leaf blocks went first, its head stayed
    assert kv.num_free_blocks == kv.num_blocks
    kv.allocator.check()


def test_recompute_of_a_preempted_request_on_a_shared_prefix():
    """A KV cache too small for every request forces recompute preemption in the colocated decode;
    the recompute starts on the blocks still cached (the shared system prompt, held by the others)
    and the tokens equal HF's."""
    system = prompts([16], seed=27)[0]
    ps = [system + t for t in prompts([14, 14, 14, 14], seed=28)]
    ref = [hf_greedy(FAMILY, p, 20) for p in ps]
    llm = _llm(14)
    starts: list[int] = []
    execute = llm.executor.execute

    def spy(plan, should_stop=None):
        starts.extend(c.start for c in plan.prefills if c.request.num_output_tokens)   # recompute chunks
        return execute(plan, should_stop)

    llm.instance.executor.execute = spy
    assert _tokens(_run(llm, ps, 20)) == ref
    assert llm.instance.scheduler.decode.num_preemptions > 0
    assert starts and max(starts) >= 16
    kv = llm.executor.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.allocator.check()


def test_pd_cluster_prefill_reuses_and_decode_gets_the_whole_prompt():
    system = prompts([40], seed=29)[0]
    ps = [system + t for t in prompts([7, 12, 3], seed=30)]
    reqs = [Request(i, 0.3 * i, len(p), 5, SLO(), prompt_token_ids=list(p),
                    sampling=SamplingParams(max_tokens=5, **GREEDY)) for i, p in enumerate(ps)]
    cluster = LocalCluster(tiny_checkpoint(FAMILY), num_prefill=1, num_decode=1,
                           config=EngineConfig(num_threads=1, block_size=BS), kv_tokens=1024)
    done = sorted(cluster.run(reqs, timeout=120), key=lambda r: r.request_id)
    assert [r.output_token_ids for r in done] == [hf_greedy(FAMILY, p, 5) for p in ps]
    assert [r.num_cached_tokens for r in done] == [0, 40, 40]
    prefill_kv, decode_kv = cluster.prefill[0].scheduler.kv, cluster.decode[0].scheduler.kv
    assert prefill_kv.prefix_caching and not decode_kv.prefix_caching
    assert prefill_kv.hit_tokens == 80 and prefill_kv.allocator.num_cached > 0
    assert decode_kv.num_free_blocks == decode_kv.num_blocks and decode_kv.allocator.num_cached == 0


def test_engine_instance_needs_a_caching_kv_manager_for_prefix_caching():
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineInstance(make("prefill", "fcfs", KVCacheManager(64, 16), prefix_caching=True), executor=None)
    caching = KVCacheManager(64, 16, prefix_caching=True)
    assert EngineInstance(make("colocated", "colocated", caching), executor=None).scheduler.prefix_caching


# ---- policies classify and predict by new tokens ---------------------------------------------------
def _kv_holding(tokens: list[int], num_blocks: int = 512) -> KVCacheManager:
    """A caching KV manager whose cache holds ``tokens``' full blocks (a finished request's)."""
    kv = KVCacheManager(num_blocks, 16, prefix_caching=True)
    done = Request(10**6, 0.0, len(tokens), 1, SLO(), prompt_token_ids=list(tokens))
    kv.allocate(done.request_id, len(tokens))
    done.num_computed_tokens = len(tokens)
    kv.register(done)
    kv.free(done.request_id)
    return kv


def _waiting(rid: int, tokens: list[int], ttft: float = 1.0) -> Request:
    return Request(rid, 0.0, len(tokens), 4, SLO(ttft, 0.1), prompt_token_ids=list(tokens))


def test_prefill_policies_see_new_tokens_after_the_cache_hit():
    from laneserve.policies.prefill.mechanisms.laps_lanes import LONG, SHORT
    history = list(range(1, 1001))
    kv = _kv_holding(history)
    turn = _waiting(1, history + [7] * 40)             # 1040 tokens, 992 cached: 48 new
    fresh = _waiting(2, list(range(2000, 3040)))
    laps = make("prefill", "laps", kv)
    assert laps.prefix_caching and laps.new_tokens(turn) == 48 and laps.new_tokens(fresh) == 1040
    assert laps.lane_of(turn) == SHORT and laps.lane_of(fresh) == LONG
    sedf = make("prefill", "sedf", kv)
    assert sedf.ordering.step_tokens(turn) == 48 and sedf.ordering.step_tokens(fresh) == 1040
    kairos = make("prefill", "kairos", kv, throughput=1000.0)
    for req in (turn, fresh):
        kairos.add_request(req, 0.0)
    (s_turn, _), (s_fresh, _) = sorted(kairos.scores(0.0), key=lambda item: item[1].request_id)
    # FCFS finish estimates: 48 new tokens, then 1040 more, at 1000 tokens/s
    assert s_turn == pytest.approx(((1.0 - 0.048) / 1.0) / 1040)
    assert s_fresh == pytest.approx(((1.0 - 1.088) / 1.0) / 1040)
    plan = kairos.schedule(0.0)
    assert [(c.request.request_id, c.start) for c in plan.prefills][0] == (1, 992)
