"""Typed policy specs: a colocated pair is two resolved specs, so every option of the decode spec
stays on the decode side (the pair was once formatted as one string and split on commas)."""

from __future__ import annotations

import httpx
import pytest

from laneserve.cluster.worker import WorkerSpec
from laneserve.core.kv import KVCacheManager
from laneserve.policies import registry
from laneserve.runtime.cluster import Deployment
from laneserve.runtime.spec import InstanceSpec, PolicySpec, colocated_spec

PREFILL = "cp-edf:chunk=512"
DECODE = "continuous:preemption=recompute,max_batch_size=8"


def _pair() -> PolicySpec:
    return Deployment(mode="colocated", prefill_policy=PREFILL, decode_policy=DECODE).front_policy


def test_colocated_pair_keeps_each_halfs_options():
    spec = _pair()
    assert spec.options.decode.options.max_batch_size == 8
    assert spec.options.decode.options.preemption == "recompute"
    assert spec.options.prefill.options.chunk == 512
    assert spec.options.prefill.options.max_batch_size == 256       # untouched: its own default
    sched = registry.make("colocated", spec, KVCacheManager(64))
    assert sched.decode.options.max_batch_size == 8
    assert sched.prefill.options.chunk == 512
    assert sched.prefill.options.max_batch_size == 256


def test_decode_options_in_either_order_are_accepted():
    spec = Deployment(mode="colocated", prefill_policy=PREFILL,
                      decode_policy="continuous:max_batch_size=8,preemption=recompute").front_policy
    assert registry.make("colocated", spec, KVCacheManager(64)).decode.options.preemption == "recompute"


def test_spec_crosses_the_spawn_arguments_unchanged():
    spec = _pair()
    inst = InstanceSpec("colocated", spec, kv_tokens=4096, host_kv_tokens=256, token_budget=64, device="cpu",
                        tensor_parallel_size=2)
    w = WorkerSpec(0, inst, "model", "in", "out", 0.0)
    back = WorkerSpec.from_json(w.to_json())
    assert back.instance == inst and back.instance.policy == spec and back.role == "colocated"


def test_wrong_kind_and_bad_option_are_refused():
    with pytest.raises(ValueError, match="decode policy"):
        registry.make("prefill", PolicySpec.parse("decode", "continuous"), KVCacheManager(64))
    with pytest.raises(ValueError, match="max_batch_size"):
        PolicySpec.parse("decode", "continuous:max_batch_size=zero")
    with pytest.raises(ValueError, match="option decode"):
        colocated_spec(PolicySpec.parse("prefill", PREFILL), 8)


def test_debug_state_shows_both_halves_of_the_pair(shared_server):
    srv = shared_server("--colocated", "--prefill-policy", PREFILL, "--decode-policy", DECODE)
    srv.wait_ready()
    state = httpx.get(srv.url + "/debug/state", timeout=10).json()
    opts = state["instances"][0]["policy_options"]["options"]
    assert opts["decode"]["options"]["max_batch_size"] == 8
    assert opts["prefill"]["options"]["chunk"] == 512
    assert opts["prefill"]["options"]["max_batch_size"] == 256
