"""A colocated instance's two policies stay two specs: the decode half's options (commas and all)
reach the decode policy, never the prefill one, whichever driver builds it, and ``/debug/state``
shows both halves as resolved."""

from __future__ import annotations

import json
import urllib.request

import pytest

from laneserve.core.kv import KVCacheManager
from laneserve.policies import registry
from laneserve.policies.spec import as_spec
from laneserve.runtime.cluster import Deployment
from laneserve.sim import ClusterConfig

PREFILL = "cp-edf:chunk=512"
DECODE = "continuous:preemption=recompute,max_batch_size=8"


def _check_halves(scheduler) -> None:
    assert scheduler.prefill.options.chunk == 512
    assert scheduler.decode.options.max_batch_size == 8
    assert scheduler.decode.options.preemption == "recompute"
    # the decode cap did not leak into the prefill policy
    assert scheduler.prefill.options.max_batch_size != 8


@pytest.mark.parametrize("decode", [DECODE, "continuous:max_batch_size=8,preemption=recompute"])
def test_the_decode_half_keeps_its_own_options(decode):
    spec = Deployment(mode="colocated", prefill_policy=PREFILL, decode_policy=decode).front_policy
    _check_halves(registry.make("colocated", spec, KVCacheManager(4096)))
    shown = spec.describe()["options"]
    assert shown["prefill"] == as_spec("prefill", PREFILL).describe()
    assert shown["decode"]["options"]["max_batch_size"] == 8 and shown["prefill"]["options"]["chunk"] == 512
    # its text form (what /debug/state and logs print) reads back as the same pair
    _check_halves(registry.make("colocated", str(spec), KVCacheManager(4096)))


def test_the_simulator_builds_the_same_pair():
    cfg = ClusterConfig(mode="colocated", num_colocated=1, prefill_policy=PREFILL, decode_policy=DECODE)
    spec = cfg.deployment.front_policy
    _check_halves(registry.make("colocated", spec, KVCacheManager(4096)))


def test_nested_specs_split_only_at_their_own_commas():
    assert registry.split_top_level("a=[x:k=1,j=2],b=y") == ["a=[x:k=1,j=2]", "b=y"]
    with pytest.raises(ValueError, match="unbalanced"):
        registry.split_top_level("a=[x:k=1")
    from laneserve.bench.experiment import split_policy_sets
    assert split_policy_sets("fcfs+continuous,colocated:prefill=[cp-edf:chunk=64],decode=[continuous:a=1,b=2]") == [
        "fcfs+continuous", "colocated:prefill=[cp-edf:chunk=64],decode=[continuous:a=1,b=2]"]


def test_debug_state_shows_the_resolved_pair(shared_server):
    srv = shared_server("--colocated", "--kv-tokens", "4096", "--prefill-policy", PREFILL,
                        "--decode-policy", DECODE)    # tests/conftest.py
    srv.wait_ready()
    with urllib.request.urlopen(srv.url + "/debug/state", timeout=30) as resp:
        state = json.loads(resp.read())
    (inst,) = state["instances"]
    opts = inst["policy_options"]["options"]
    assert inst["policy_options"]["name"] == "colocated"
    assert opts["decode"]["name"] == "continuous"
    assert opts["decode"]["options"]["max_batch_size"] == 8
    assert opts["decode"]["options"]["preemption"] == "recompute"
    assert opts["prefill"]["options"]["chunk"] == 512
