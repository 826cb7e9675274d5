"""KV hand-off between TP groups through Ray's object store (the ``ray`` KV transport), the same
code path as shared memory (laneserve/engine/tp/kv_reshard.py): a prefill actor puts its ranks'
shards under leases and sends one descriptor, a decode actor gets them and cuts each of its
ranks' heads; nothing stays leased. A local Ray instance (two CPUs) and two actors."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from laneserve.cluster.ray_cluster import InstanceHost  # noqa: E402

PAIRS = [(4, 2, 4), (1, 2, 1), (3, 1, 3), (2, 4, 8)]


def _full_kv(num_kv_heads: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 5, num_kv_heads, 4, generator=g)


class KVActor(InstanceHost):
    """An instance actor's KV side: serves ``claim_kv``/``release_kv`` and puts or gets KV."""

    def __init__(self, name: str) -> None:
        from laneserve.cluster.ray_kv import RayObjectTransport
        self.transport = RayObjectTransport(owner=name, timeout=30.0)

    def put(self, rid: int, heads: int, tp: int, seed: int) -> dict:
        from laneserve.engine.kv_cache import KVPayload
        from laneserve.engine.tp.kv_reshard import ShardedKVPayload, kv_heads_of_rank, put_sharded
        full = _full_kv(heads, seed)
        shards = [KVPayload(5, full[:, :, :, kv_heads_of_rank(heads, tp, r)].clone()) for r in range(tp)]
        return put_sharded(self.transport, rid, ShardedKVPayload(heads, shards))

    def get(self, desc: dict, heads: int, tp: int) -> list[torch.Tensor]:
        from laneserve.engine.tp.kv_reshard import get_sharded, kv_for_rank
        payload = get_sharded(self.transport, desc)
        return [kv_for_rank(payload, heads, tp, r).kv.clone() for r in range(tp)]

    def held(self) -> int:
        return self.transport.held()


@pytest.fixture(scope="module")
def actors():
    import sys

    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the actor class lives in this test
    ray.init(address="local", num_cpus=2, namespace="laneserve-tp-test", logging_level="warning", include_dashboard=False)
    try:
        cls = ray.remote(num_cpus=0, max_concurrency=4)(KVActor)
        yield [cls.options(name=name).remote(name) for name in ("tp-prefill", "tp-decode")]
    finally:
        ray.shutdown()


@pytest.mark.parametrize("tp_src, tp_dst, heads", PAIRS)
def test_every_pair_through_the_object_store(actors, tp_src, tp_dst, heads):
    from laneserve.engine.tp.kv_reshard import kv_heads_of_rank
    prefill, decode = actors
    seed = tp_src * 10 + tp_dst
    desc = ray.get(prefill.put.remote(seed, heads, tp_src, seed), timeout=60)
    assert desc["t"] == "sharded" and len(desc["shards"]) == tp_src
    assert ray.get(prefill.held.remote(), timeout=60) == tp_src
    got = ray.get(decode.get.remote(desc, heads, tp_dst), timeout=60)
    full = _full_kv(heads, seed)
    for r in range(tp_dst):
        assert torch.equal(got[r], full[:, :, :, kv_heads_of_rank(heads, tp_dst, r)]), f"rank {r}"
    assert ray.get(prefill.held.remote(), timeout=60) == 0          # every lease claimed


def test_a_discarded_transfer_releases_every_lease(actors):
    from laneserve.cluster.transport import discard_descriptor
    prefill, _decode = actors
    desc = ray.get(prefill.put.remote(99, 4, 4, 0), timeout=60)
    assert ray.get(prefill.held.remote(), timeout=60) == 4
    discard_descriptor(desc)                                   # the router's discard
    deadline = 50
    while ray.get(prefill.held.remote(), timeout=60) and deadline:   # release is fire-and-forget
        deadline -= 1
        ray.get(prefill.node_id.remote(), timeout=60)
    assert ray.get(prefill.held.remote(), timeout=60) == 0
