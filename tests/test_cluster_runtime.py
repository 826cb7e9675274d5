"""The cluster runtime (runtime/cluster.py): one deployment spec, one place for the routers and the
hand-off, and one default policy pair for every entry point."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest

from laneserve.core import SLO
from laneserve.core.request import Phase, Request
from laneserve.runtime.cluster import (DEFAULT_DECODE_POLICY, DEFAULT_PREFILL_POLICY, ClusterRuntime, Deployment,
                                       NoDestination, make_routers)


@dataclass
class FakeInstance:
    """What a router reads of an instance (InstanceLoad), nothing else."""

    instance_id: int
    role: str
    accepting: bool = True
    queued_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0


@dataclass
class RecordingLink:
    taken: list = field(default_factory=list)
    delivered: list = field(default_factory=list)
    discarded: list = field(default_factory=list)

    def take(self, source, req, now):
        self.taken.append((source.instance_id, req.request_id))
        return f"kv-{req.request_id}"

    def deliver(self, req, dest, payload, now):
        self.delivered.append((req.request_id, dest.instance_id, payload))

    def discard(self, req, payload):
        self.discarded.append(payload)


def _request(rid: int = 1) -> Request:
    return Request(rid, 0.0, 100, 4, SLO(ttft=1.0, tpot=0.05))


def _runtime(deployment: Deployment, n_front: int = 2, n_back: int = 2):
    front = [FakeInstance(i, "prefill") for i in range(n_front)]
    back = [FakeInstance(n_front + j, "decode") for j in range(n_back)]
    link = RecordingLink()
    runtime = ClusterRuntime(deployment, link, front=front, back=back, step_model=lambda: (None, None))
    return runtime, link, front, back


def test_every_entry_point_defaults_to_one_deployment():
    """ClusterConfig(), ClusterSpec, LocalCluster, LLM and the two commands share one default:
    adaptive prefill + adaptive decode, round-robin admission, the decode policy's own decode router."""
    from laneserve.cli import build_parser
    from laneserve.cluster.local import LocalCluster
    from laneserve.cluster.process import ClusterSpec
    from laneserve.engine.llm import LLM
    from laneserve.sim import ClusterConfig

    default = Deployment()
    assert (default.prefill_policy, default.decode_policy) == (DEFAULT_PREFILL_POLICY, DEFAULT_DECODE_POLICY) \
        == ("adaptive", "adaptive")
    assert ClusterConfig().deployment == default
    spec = ClusterSpec(model="m")                     # typed specs, the same policies
    assert spec.deployment.specs == default.specs and spec.deployment.decode_router == default.decode_router
    assert str(spec.router) == default.router and spec.deployment.decode_router_name() == default.decode_router_name()
    local = inspect.signature(LocalCluster).parameters
    assert Deployment(**{k: local[k].default for k in ("prefill_policy", "decode_policy", "router",
                                                        "decode_router")}) == default
    assert inspect.signature(LLM).parameters["policy"].default is None   # None: Deployment's colocated policy
    pair = Deployment(mode="colocated").front_policy                   # the two typed halves
    assert (pair.name, pair.options.prefill.name, pair.options.decode.name) == ("colocated", "adaptive", "adaptive")
    serve = build_parser().parse_args(["serve", "--model", "m"])
    assert (serve.prefill_policy, serve.decode_policy, serve.router, serve.decode_router) == (
        default.prefill_policy, default.decode_policy, default.router, default.decode_router)
    sim = build_parser().parse_args(["sim"])
    assert sim.policies.split(",")[0] == f"{default.prefill_policy}+{default.decode_policy}"
    assert (sim.router, sim.decode_router) == (default.router, default.decode_router)


def test_deployment_roles_and_checks():
    d = Deployment(num_prefill=2, num_decode=3, prefill_policy="fcfs", decode_policy="continuous")
    assert [(r, str(p)) for r, p in d.roles()] == [("prefill", "fcfs")] * 2 + [("decode", "continuous")] * 3
    assert d.roles()[0][1] is d.roles()[1][1] is d.front_policy     # resolved once, not per access
    assert d.decode_router_name() == "least-loaded"            # continuous has no router of its own
    assert Deployment().decode_router_name() == "tpot-aware"  # adaptive's
    colo = Deployment(mode="colocated", num_prefill=2, colocated_policy="colocated:prefill=fcfs")
    assert [(r, str(p)) for r, p in colo.roles()] == [("colocated", "colocated:prefill=fcfs")] * 2
    assert colo.decode_router_name() is None
    with pytest.raises(ValueError, match="mode"):
        Deployment(mode="mesh")
    with pytest.raises(ValueError, match="at least one"):
        Deployment(num_decode=0)
    assert [r for r, _ in Deployment(mode="colocated", num_decode=0).roles()] == ["colocated"]   # no decode side


def test_make_routers_binds_a_step_model_only_where_the_router_predicts_steps():
    bound = []
    router, decode = make_routers(Deployment(), lambda: bound.append(1) or ("model", "learner"))
    assert router.name == "round-robin" and decode.name == "tpot-aware" and bound == [1]
    assert decode.learner == "learner"
    with pytest.raises(ValueError, match="predicts step times"):
        make_routers(Deployment())
    _, decode = make_routers(Deployment(decode_policy="continuous"), lambda: bound.append(2))
    assert decode.name == "least-loaded" and bound == [1]       # not asked for a model
    assert make_routers(Deployment(mode="colocated"))[1] is None


def test_admit_routes_among_the_front_and_names_the_instance():
    runtime, _, front, _ = _runtime(Deployment(decode_policy="continuous"))
    picked = [runtime.admit(_request(i), 0.0) for i in range(4)]
    assert [p.instance_id for p in picked] == [0, 1, 0, 1]      # round-robin
    front[0].accepting = False
    req = _request(9)
    assert runtime.admit(req, 0.0) is front[1] and req.prefill_instance == 1


def test_hand_off_takes_routes_and_delivers_once():
    runtime, link, front, back = _runtime(Deployment(decode_policy="continuous"))
    back[0].kv_usage = 0.9                                       # least-loaded picks the other one
    req = _request(5)
    dest = runtime.on_prefilled(req, front[1], 1.0)
    assert dest is back[1] and req.decode_instance == back[1].instance_id and req.phase is Phase.TRANSFERRING
    assert link.taken == [(1, 5)] and link.delivered == [(5, back[1].instance_id, "kv-5")] and not link.discarded
    # a payload the source already exported (another process) is forwarded as it is, not taken again
    runtime.on_prefilled(_request(6), front[0], 2.0, payload="remote-kv")
    assert link.taken == [(1, 5)] and link.delivered[-1][2] == "remote-kv"


def test_hand_off_without_a_destination_discards_the_kv():
    runtime, link, front, back = _runtime(Deployment(decode_policy="continuous"))
    for b in back:
        b.accepting = False
    with pytest.raises(NoDestination, match="no decode instance"):
        runtime.on_prefilled(_request(7), front[0], 1.0)
    assert link.discarded == ["kv-7"] and not link.delivered


def test_on_lost_names_what_the_instance_held():
    runtime, _, front, back = _runtime(Deployment(decode_policy="continuous"))

    @dataclass
    class Track:
        rid: int
        instance: int

    held = [Track(1, 0), Track(2, back[0].instance_id), Track(3, 0)]
    assert [t.rid for t in runtime.on_lost(front[0], held)] == [1, 3]
    assert runtime.on_lost(back[1], held) == []


@pytest.mark.parametrize("colocated", [False, True])
def test_the_cli_hands_the_cluster_typed_specs_that_nothing_parses_again(monkeypatch, colocated):
    """``serve``'s policy flags are read once (``policy_specs``); the cluster's deployment, its
    instances and its routers are built from the typed specs without reading any text again."""
    from laneserve.cli import build_parser
    from laneserve.cluster.process import ClusterSpec
    from laneserve.commands.serve import policy_specs
    from laneserve.policies import registry
    from laneserve.policies.spec import PolicySpec
    words = ["serve", "--stub", "--prefill-policy", "cp-edf:chunk=512", "--decode-policy", "adaptive:max_batch_size=8",
             "--router-policy", "least-loaded", *(["--colocated"] if colocated else [])]
    specs = policy_specs(build_parser().parse_args(words))
    assert all(isinstance(v, PolicySpec) for v in specs.values()) and specs["decode_router"].name == "tpot-aware"
    spec = ClusterSpec(model="", colocated=colocated, **specs)
    monkeypatch.setattr(registry, "_split_spec", lambda *a: pytest.fail(f"policy text parsed downstream: {a}"))
    deployment = spec.deployment
    roles = {s.role: s.policy for s in spec.instance_specs(deployment)}
    router, decode_router = make_routers(deployment, lambda: (None, None))
    assert router.name == "least-loaded" and (decode_router is None) == colocated
    prefill, decode = (roles["colocated"].options.prefill, roles["colocated"].options.decode) if colocated else (
        roles["prefill"], roles["decode"])
    assert (prefill.options.chunk, decode.options.max_batch_size) == (512, 8)


def test_a_cluster_spec_refuses_policy_text():
    from laneserve.cluster.process import ClusterSpec
    with pytest.raises(TypeError, match="ClusterSpec.decode_policy must be a decode PolicySpec"):
        ClusterSpec(model="m", decode_policy="adaptive")
    with pytest.raises(TypeError, match="ClusterSpec.router must be a router PolicySpec"):
        ClusterSpec(model="m", router=ClusterSpec(model="m").prefill_policy)
