"""KV hand-off between tensor-parallel groups (laneserve/engine/tp/kv_reshard.py): which heads a
rank owns, and for every pair of degrees (4->4, 2->1, 1->2, 4->2, 3->1, with split and replicated
heads) each destination rank receives exactly the source KV's heads it owns, in memory and through
the cluster runtime's hand-off over the shm and inline transports, leaving no shared memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from laneserve.cluster.transport import discard_descriptor, make_transport
from laneserve.core import SLO
from laneserve.core.request import Request
from laneserve.engine.kv_cache import KVPayload
from laneserve.engine.tp.kv_reshard import (Piece, ShardedKVPayload, discard_sharded, get_sharded, kv_for_rank,
                                            kv_heads_of_rank, put_sharded, read_for_rank, reshard_plan)
from laneserve.runtime.cluster import ClusterRuntime, Deployment, NoDestination

# (tp_src, tp_dst, num_kv_heads): the pairs, with heads split, replicated on either side, MQA
PAIRS = [(4, 4, 4), (4, 4, 8), (2, 1, 2), (2, 1, 4), (1, 2, 2), (1, 2, 1), (4, 2, 4), (4, 2, 2),
         (4, 2, 1), (3, 1, 3), (3, 1, 1), (1, 4, 2), (2, 4, 8)]


def _full_kv(num_kv_heads: int, tokens: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, tokens, num_kv_heads, 4, generator=g)     # [layers, K/V, tokens, heads, dim]


def _source(full: torch.Tensor, tp: int) -> ShardedKVPayload:
    n = full.shape[3]
    shards = [KVPayload(full.shape[2], full[:, :, :, kv_heads_of_rank(n, tp, r)].clone()) for r in range(tp)]
    return ShardedKVPayload(n, shards)


def _expected(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return full[:, :, :, kv_heads_of_rank(full.shape[3], tp, rank)]


def test_heads_of_rank_split_and_replicate_as_vllm():
    assert [list(kv_heads_of_rank(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads_of_rank(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of_rank(1, 3, r)) for r in range(3)] == [[0], [0], [0]]
    assert [list(kv_heads_of_rank(3, 3, r)) for r in range(3)] == [[0], [1], [2]]
    assert list(kv_heads_of_rank(4, 1, 0)) == [0, 1, 2, 3]


@pytest.mark.parametrize("heads, tp, match", [(3, 2, "3 KV heads cannot be split across 2 ranks"),
                                              (2, 3, "2 KV heads cannot be replicated across 3 ranks"),
                                              (0, 1, "must be >= 1")])
def test_heads_of_rank_refuses_impossible_degrees(heads, tp, match):
    with pytest.raises(ValueError, match=match):
        kv_heads_of_rank(heads, tp, 0)
    with pytest.raises(ValueError, match="rank 4 outside a TP-4 group"):
        kv_heads_of_rank(4, 4, 4)


def test_plan_merges_adjacent_heads_and_spreads_replica_readers():
    assert reshard_plan(4, 4, 2) == [[Piece(0, 0, 0, 1), Piece(1, 0, 1, 1)], [Piece(2, 0, 0, 1), Piece(3, 0, 1, 1)]]
    assert reshard_plan(4, 2, 1) == [[Piece(0, 0, 0, 2), Piece(1, 0, 2, 2)]]
    # head 0 lives on source ranks 0 and 1 (TP4 over 2 heads): TP1's single rank reads rank 0
    assert reshard_plan(2, 4, 1) == [[Piece(0, 0, 0, 1), Piece(2, 0, 1, 1)]]
    assert reshard_plan(1, 2, 2) == [[Piece(0, 0, 0, 1)], [Piece(1, 0, 0, 1)]]


@pytest.mark.parametrize("tp_src, tp_dst, heads", PAIRS)
def test_every_pair_round_trips_in_memory(tp_src, tp_dst, heads):
    full = _full_kv(heads, seed=tp_src * 10 + tp_dst)
    payload = _source(full, tp_src)
    for r in range(tp_dst):
        got = kv_for_rank(payload, heads, tp_dst, r)
        assert got.num_tokens == full.shape[2]
        assert torch.equal(got.kv, _expected(full, tp_dst, r)), f"{tp_src}->{tp_dst} rank {r}"


def test_a_plain_payload_is_a_tp1_source():
    full = _full_kv(4)
    plain = KVPayload(full.shape[2], full.clone())
    for r in range(2):
        assert torch.equal(kv_for_rank(plain, 4, 2, r).kv, _expected(full, 2, r))
    with pytest.raises(ValueError, match="payload has 4 KV heads, the model 2"):
        kv_for_rank(_source(full, 2), 2, 1, 0)


def test_inconsistent_shards_are_refused():
    full = _full_kv(4)
    with pytest.raises(ValueError, match="rank 1 of TP-2 holds 2 of 4 KV heads"):
        ShardedKVPayload(4, [KVPayload(7, full[:, :, :, :2]), KVPayload(7, full[:, :, :, 2:3])])
    with pytest.raises(ValueError, match="disagree on the token count"):
        ShardedKVPayload(4, [KVPayload(7, full[:, :, :, :2]), KVPayload(6, full[:, :, :6, 2:])])


# ---- through the runtime's hand-off -----------------------------------------------------------------
@dataclass
class Group:
    """A TP instance as the routers see it, holding (source) or receiving (destination) KV per rank."""

    instance_id: int
    role: str
    tp: int
    kv: dict = field(default_factory=dict)          # request id -> the full KV (source) / per-rank KV
    accepting: bool = True
    queued_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0


class TransportLink:
    """The process driver's link in miniature: the source's ranks export their shards, the
    transport carries one descriptor, every destination rank imports its heads."""

    def __init__(self, transport, num_kv_heads: int) -> None:
        self.transport, self.heads = transport, num_kv_heads

    def take(self, source: Group, req: Request, now: float):
        payload = _source(source.kv.pop(req.request_id), source.tp)
        return put_sharded(self.transport, req.request_id, payload)

    def deliver(self, req: Request, dest: Group, desc, now: float) -> None:
        payload = get_sharded(self.transport, desc)
        dest.kv[req.request_id] = [kv_for_rank(payload, self.heads, dest.tp, r).kv for r in range(dest.tp)]

    def discard(self, req: Request, desc) -> None:
        discard_sharded(self.transport, desc)


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("tp_src, tp_dst, heads", PAIRS)
def test_every_pair_through_the_runtime_hand_off(tmp_path: Path, transport, tp_src, tp_dst, heads):
    link = TransportLink(make_transport(transport, directory=tmp_path), heads)
    source, dest = Group(0, "prefill", tp_src), Group(1, "decode", tp_dst)
    runtime = ClusterRuntime(Deployment(decode_router="least-loaded"), link, front=[source], back=[dest])
    fulls = {}
    for rid in range(3):
        fulls[rid] = _full_kv(heads, tokens=5 + rid, seed=rid)
        source.kv[rid] = fulls[rid]
        assert runtime.on_prefilled(Request(rid, 0.0, 5 + rid, 4, SLO(ttft=1.0, tpot=0.05)), source, 0.0) is dest
    for rid, full in fulls.items():
        for r in range(tp_dst):
            assert torch.equal(dest.kv[rid][r], _expected(full, tp_dst, r)), f"request {rid} rank {r}"
    assert list(tmp_path.iterdir()) == []                   # every shard's shared memory unlinked


def test_no_destination_and_router_discard_leave_no_shared_memory(tmp_path: Path):
    link = TransportLink(make_transport("shm", directory=tmp_path), 4)
    source, dest = Group(0, "prefill", 4), Group(1, "decode", 2, accepting=False)
    runtime = ClusterRuntime(Deployment(decode_router="least-loaded"), link, front=[source], back=[dest])
    source.kv[0] = _full_kv(4)
    with pytest.raises(NoDestination):
        runtime.on_prefilled(Request(0, 0.0, 7, 4, SLO(ttft=1.0, tpot=0.05)), source, 0.0)
    assert list(tmp_path.iterdir()) == []
    desc = put_sharded(link.transport, 1, _source(_full_kv(4), 4))
    assert len(list(tmp_path.iterdir())) == 4
    discard_descriptor(desc)                                # the router's discard, no torch needed
    assert list(tmp_path.iterdir()) == []


def test_a_shard_that_cannot_be_read_drops_the_others(tmp_path: Path):
    transport = make_transport("shm", directory=tmp_path)
    desc = put_sharded(transport, 2, _source(_full_kv(4), 4))
    Path(desc["shards"][1]["path"]).unlink()                # lost on the way
    with pytest.raises(FileNotFoundError):
        get_sharded(transport, desc)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not a sharded KV descriptor"):
        get_sharded(transport, {"t": "shm"})


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("tp_src, tp_dst, heads", PAIRS)
def test_each_destination_rank_reads_its_heads_from_shared_memory(tmp_path: Path, transport, tp_src, tp_dst, heads):
    """Destination ranks as processes beside the source: each reads only its pieces out of the
    shards' shared memory (nothing consumed), then one discard frees every shard."""
    transport_ = make_transport(transport, directory=tmp_path)
    full = _full_kv(heads, seed=tp_src + 7 * tp_dst)
    desc = put_sharded(transport_, 5, _source(full, tp_src))
    for r in reversed(range(tp_dst)):              # any order, each shard read by any number of ranks
        got = read_for_rank(desc, tp_dst, r)
        assert got.num_tokens == full.shape[2]
        assert torch.equal(got.kv, _expected(full, tp_dst, r)), f"rank {r}"
    discard_sharded(transport_, desc)
    assert list(tmp_path.iterdir()) == []


def test_ray_shards_are_not_read_per_rank():
    desc = {"t": "sharded", "heads": 2, "n": 3, "shards": [{"t": "ray", "owner": "x", "key": "k"}]}
    with pytest.raises(ValueError, match="'ray' shard is read once, by get_sharded"):
        read_for_rank(desc, 2, 0)


@pytest.mark.parametrize("tp_src", [1, 2, 4])
def test_engine_decode_from_resharded_kv_matches_a_colocated_run(tmp_path: Path, tp_src):
    """A real prefill's KV (tiny Llama, 2 KV heads) cut as the ranks of a TP-``tp_src`` prefill
    instance hold it (TP4: each head on two ranks), handed off by the runtime over ``shm`` to a TP1
    decode instance, decodes the tokens a colocated run gives."""
    from engine_support import Driver, make_executor, make_request, prompts
    ps = prompts([19, 7], seed=21)
    colocated = Driver(make_executor("llama")).run([make_request(i, p, 6) for i, p in enumerate(ps)])
    prefill, decode = make_executor("llama", block_size=8), make_executor("llama", block_size=16)
    heads = prefill.model.config.num_kv_heads
    reqs = [make_request(i, p, 6) for i, p in enumerate(ps)]
    Driver(prefill).step([(r, r.prompt_len) for r in reqs], [])
    link = TransportLink(make_transport("shm", directory=tmp_path), heads)
    source, dest = Group(0, "prefill", tp_src), Group(1, "decode", 1)
    runtime = ClusterRuntime(Deployment(decode_router="least-loaded"), link, front=[source], back=[dest])
    for r in reqs:
        source.kv[r.request_id] = prefill.export_kv(r.request_id, r.prompt_len).kv
        prefill.kv.free(r.request_id)
        runtime.on_prefilled(r, source, 0.0)
        decode.kv.allocate(r.request_id, r.prompt_len)
        decode.import_kv(r.request_id, KVPayload(r.prompt_len, dest.kv[r.request_id][0]))
    assert list(tmp_path.iterdir()) == []
    assert Driver(decode).run(reqs) == colocated
