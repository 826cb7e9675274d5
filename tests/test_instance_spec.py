"""InstanceSpec and build_instance (runtime/spec.py, runtime/build.py): one typed instance spec,
checked where it is made, and one recipe every driver builds an instance with, supplying only its
resources; a deployment's policies read once; a policy's options built once."""

from __future__ import annotations

import pytest

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.costmodel.analytic import AnalyticCostModel
from laneserve.costmodel.specs import HARDWARE, MODELS
from laneserve.policies import options as options_module
from laneserve.policies import registry
from laneserve.runtime.build import InstanceResources, build_instance
from laneserve.runtime.spec import InstanceSpec, PolicySpec
from laneserve.sim.config import ClusterConfig
from laneserve.sim.simulator import Simulator

_COST = AnalyticCostModel(MODELS["llama-3-8b"], HARDWARE["h100"])


class _Resources(InstanceResources):
    """A driver that records what build_instance asked of it."""

    def __init__(self, defaults=None, predictors=None) -> None:
        self.defaults, self.bound, self.asked = defaults or {}, predictors, []

    def kv(self, spec):
        return KVCacheManager(spec.kv_tokens // 16, 16)

    def host_pool(self, spec):
        self.asked.append(spec.role)
        return HostKVPool(spec.host_kv_tokens // 16, 16) if spec.host_kv_tokens else None

    def policy_defaults(self, spec):
        return self.defaults

    def predictors(self):
        return self.bound

    def instance(self, instance_id, spec, scheduler, kv, host, learner):
        return instance_id, scheduler, kv, host, learner


def test_bad_instance_specs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="role"):
        InstanceSpec.of("mixed", "fcfs")
    with pytest.raises(ValueError, match="decode policy spec"):
        InstanceSpec("decode", PolicySpec.parse("prefill", "fcfs"))
    for field, value in (("kv_tokens", 0), ("tensor_parallel_size", 0), ("host_kv_tokens", -1),
                         ("token_budget", 1.5), ("device", "")):
        with pytest.raises(ValueError, match=field):
            InstanceSpec.of("decode", "continuous", **{field: value})
    with pytest.raises(ValueError, match="unknown decode policy"):
        InstanceSpec.of("decode", "nope")


def test_build_instance_wires_the_spec_over_the_drivers_defaults():
    spec = InstanceSpec.of("colocated", "colocated:prefill=[cp-edf:chunk=512],decode=[continuous:max_batch_size=8]",
                           kv_tokens=4096, host_kv_tokens=256, token_budget=96)
    res = _Resources(defaults={"token_budget": 1, "prefix_caching": False})
    _, sched, kv, host, learner = build_instance(3, spec, res)
    assert sched.token_budget == 96 and sched.kv is kv and kv.num_blocks == 256
    assert sched.prefill.options.chunk == 512 and sched.decode.options.max_batch_size == 8
    assert host is not None and host.num_blocks == 16 and learner is None
    # a prefill instance gets no host pool (not even asked); the spec's own options beat the defaults
    res = _Resources(defaults={"max_batch_size": 1, "chunk": 64})
    _, sched, _, host, _ = build_instance(0, InstanceSpec.of("prefill", "cp-edf:chunk=128", kv_tokens=160), res)
    assert (sched.options.chunk, sched.options.max_batch_size, host, res.asked) == (128, 1, None, [])


def test_predictors_go_only_to_policies_that_read_them():
    reads = build_instance(0, InstanceSpec.of("prefill", "sedf", kv_tokens=4096), _Resources(predictors=(_COST, "L")))
    plain = build_instance(0, InstanceSpec.of("prefill", "fcfs", kv_tokens=4096), _Resources(predictors=(_COST, "L")))
    assert reads[4] == "L" and plain[4] is None


def test_cluster_config_sizes_each_role_and_the_simulator_builds_from_it():
    cfg = ClusterConfig(prefill_policy="fcfs", decode_policy="alignedserve", prefill_kv_tokens=4096,
                        decode_kv_tokens=8192)
    assert cfg.deployment is cfg.deployment                       # computed once, not per access
    pre, dec = cfg.instance_specs()
    assert (pre.role, pre.kv_tokens, pre.host_kv_tokens) == ("prefill", 4096, 0)
    assert (dec.role, dec.kv_tokens, dec.host_kv_tokens) == ("decode", 8192, None)   # needs a pool: the default
    sim = Simulator(cfg, _COST)
    front, back = sim._make_instances()
    assert front[0].scheduler.kv.num_blocks == 4096 // 16 and back[0].scheduler.kv.num_blocks == 8192 // 16
    assert back[0].scheduler.host_pool.num_blocks > 0
    colo = ClusterConfig(mode="colocated", num_colocated=2, prefill_kv_tokens=1024, host_kv_tokens=512)
    assert [(s.role, s.kv_tokens, s.host_kv_tokens) for s in colo.instance_specs()] == [("colocated", 1024, 512)] * 2


def test_make_builds_a_policys_options_once(monkeypatch):
    built = []
    original = options_module.PolicyOptions.__post_init__

    def counting(self):
        built.append(type(self).__name__)
        original(self)
    monkeypatch.setattr(options_module.PolicyOptions, "__post_init__", counting)
    sched = registry.make("prefill", "cp-edf:chunk=256", KVCacheManager(64), max_batch_size=4)
    assert built == ["ChunkedEDFOptions"] and (sched.options.chunk, sched.options.max_batch_size) == (256, 4)
