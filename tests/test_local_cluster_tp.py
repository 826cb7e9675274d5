"""``LocalCluster`` with a tensor-parallel degree per role: a TP2 prefill instance hands its sharded
KV to a TP1 decode instance and every request's greedy tokens equal those of an all-TP1 cluster;
``close`` leaves no rank process."""

from __future__ import annotations

import multiprocessing

import pytest
from engine_support import prompts
from laneserve.cluster import LocalCluster
from laneserve.core import SLO, Request, SamplingParams
from laneserve.engine import EngineConfig
from tp_support import VOCAB, tp_checkpoint


def _requests() -> list[Request]:
    ps = [[min(t, VOCAB - 2) for t in p] for p in prompts([12, 40, 3, 25], seed=5)]
    return [Request(i, 0.01 * i, len(p), 6, SLO(), prompt_token_ids=list(p),
                    sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for i, p in enumerate(ps)]


def _tokens(**degrees) -> dict[int, list[int]]:
    with LocalCluster(tp_checkpoint("llama"), config=EngineConfig(num_threads=1), kv_tokens=2048,
                      **degrees) as cluster:
        done = cluster.run(_requests(), timeout=300)
        ranks = [p for ex in cluster.tp_executors for p in ex.group.procs]
        assert len(ranks) == sum(d - 1 for d in degrees.values())
    assert not [p for p in ranks if p.is_alive()]
    return {r.request_id: r.output_token_ids for r in done}


def test_tp2_prefill_to_tp1_decode_matches_one_rank_everywhere():
    ref = _tokens()
    assert len(ref) == 4 and all(len(t) == 6 for t in ref.values())
    assert _tokens(prefill_tensor_parallel_size=2) == ref
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("laneserve-tp-rank")]


def test_a_degree_below_one_is_refused():
    with pytest.raises(ValueError, match="decode_tensor_parallel_size must be a positive integer, got 0"):
        LocalCluster(tp_checkpoint("llama"), decode_tensor_parallel_size=0)
