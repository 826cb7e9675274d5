"""A tensor-parallel instance on Ray (``laneserve serve --ray-address ... --colocated -tp 2``), on
a one-node Ray cluster of two CPUs simulated here: the instance gets one placement group of two
CPU bundles, its actor (rank 0, the runtime) in bundle 0 and one rank actor in bundle 1; it
answers greedily as the same model on one rank; a killed rank actor takes the instance down and it
restarts in a new group (the old one removed); stopping the server removes the group and ends
the actors. One Ray cluster and one server for the module; every wait is bounded."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from server_support import TIMEOUT, Server, wait_for

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from laneserve.core.sampling import SamplingParams  # noqa: E402
from laneserve.engine.llm import LLM  # noqa: E402

PROMPTS = ["The quick brown fox", "hello the world " * 6]
STORE = 80 << 20                   # object store: small, nothing large goes through it here


@pytest.fixture(scope="module")
def env():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"laneserve_colocated": 1}, "object_store_memory": STORE})
    server = None
    try:
        ray.init(address=cluster.address, namespace="laneserve-tp-test", logging_level="warning")
        server = Server("--ray-address", cluster.address, "--colocated", "-tp", "2", "--kv-tokens", "4096")
        ref = LLM(quiet=True).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        server.wait_ready()
        yield {"server": server, "ref": [r.text for r in ref]}
    finally:
        if server is not None:
            server.stop()
        ray.shutdown()
        cluster.shutdown()


def _actors(cls: str) -> list[dict]:
    return [a for a in ray._private.state.actors().values() if a["ActorClassName"] == cls]


def test_tp2_instance_on_ray_answers_as_one_rank(env):
    s = env["server"]
    for prompt, ref in zip(PROMPTS, env["ref"]):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref


def test_a_killed_rank_actor_restarts_the_instance_in_a_new_group(env):
    s = env["server"]
    old = s.state()["instances"][0]
    os.kill(old["rank_pids"][0], signal.SIGKILL)

    def restarted() -> dict | None:
        inst = s.state()["instances"][0]
        pg = inst.get("placement_group")
        return inst if inst["status"] == "ready" and pg not in (None, old["placement_group"]) else None
    new = wait_for(restarted, 120, "the instance to restart in a new placement group")
    assert new["rank_pids"] != old["rank_pids"] and len(new["rank_pids"]) == 1
    assert ray.util.placement_group_table()[old["placement_group"]]["state"] == "REMOVED"
    test_tp2_instance_on_ray_answers_as_one_rank(env)


def test_two_actors_in_one_placement_group_removed_with_the_instance(env):
    inst = env["server"].state()["instances"][0]
    assert inst["tensor_parallel_size"] == 2 and len(inst["rank_pids"]) == 1
    table = ray.util.placement_group_table()
    pg = table[inst["placement_group"]]
    assert pg["state"] == "CREATED" and pg["strategy"] == "STRICT_PACK"
    assert pg["bundles"] == {0: {"CPU": 1.0, "laneserve_colocated": 1.0}, 1: {"CPU": 1.0}}
    # both bundles' CPU taken: the instance actor holds bundle 0, the rank actor bundle 1
    free = ray.available_resources()
    assert [free.get(f"CPU_group_{i}_{inst['placement_group']}", 0.0) for i in (0, 1)] == [0.0, 0.0]
    ranks = [a for a in _actors("RankHost") if a["State"] == "ALIVE"]
    assert [a["Pid"] for a in ranks] == inst["rank_pids"]
    assert [a["Pid"] for a in _actors("InstanceHost") if a["State"] == "ALIVE"] == [inst["pid"]]
    env["server"].stop()
    wait_for(lambda: ray.util.placement_group_table()[inst["placement_group"]]["state"] == "REMOVED", 30,
             "the placement group to be removed")
    wait_for(lambda: all(a["State"] == "DEAD" for a in _actors("RankHost") + _actors("InstanceHost")), 30,
             "the instance and rank actors to end")


def test_the_step_channel_reaches_a_rank_actor_through_its_semaphores_names():
    """A rank actor is not spawned by rank 0: the channel's semaphores go to it by name, the pickle
    ``multiprocessing`` makes only while it spawns (plain pickling refuses them)."""
    import multiprocessing
    import pickle
    import time

    from laneserve.engine.tp.channel import ChannelReader, StepChannel
    from laneserve.engine.tp.ray_ranks import _dumps

    channel = StepChannel.create(multiprocessing.get_context("spawn"), 1)
    try:
        with pytest.raises(RuntimeError, match="inheritance"):
            pickle.dumps(channel.handle(0))
        reader = ChannelReader(pickle.loads(_dumps(channel.handle(0))))
        deadline = time.monotonic() + 20.0                # past it, either side raises ChannelClosed

        def in_time() -> bool:
            return time.monotonic() < deadline
        for message in (("step", 1), ("step", 2)):       # the second needs the reader's "taken"
            channel.publish(message, in_time, poll_s=0.2)
            assert reader.receive(in_time, poll_s=0.2) == message
        reader.close()
    finally:
        channel.close()
