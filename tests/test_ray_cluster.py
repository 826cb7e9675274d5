"""Instances as Ray actors across nodes, on a multi-node Ray cluster simulated on this
machine (``ray.cluster_utils.Cluster``): a head, one node offering ``laneserve_prefill``, one
offering ``laneserve_decode``. One cluster and two servers: ``laneserve serve --ray-address``
on the cluster for the module, and the single-machine ZeroMQ deployment (1P+1D) to compare with,
the session's (tests/conftest.py).
The node-loss test runs last: it removes the decode node and adds a new one. Every wait is
bounded and fails when what it waits for does not happen."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_support import Server, wait_all_free, wait_for

ray = pytest.importorskip("ray")
pytest.importorskip("openai")
from ray.cluster_utils import Cluster  # noqa: E402

from laneserve.cluster.ray_cluster import InstanceHost  # noqa: E402
from laneserve.cluster.ray_kv import KVLeases, RayObjectTransport  # noqa: E402

MODEL = "smoke-llama"
STORE = 80 << 20                   # object store per node: small, the KV of a smoke model is KBs
PROMPTS = ["hello the world", "the model serve token " * 40, "a b c d e f g h i j k l m n o p q r s t u v w"]


@pytest.fixture(scope="module")
def env(shared_server):
    # the session's 1P+1D server (tests/conftest.py): loads while the cluster starts, if not up already
    zmqsrv = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")
    servers = []
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE})
    try:
        nodes = {"prefill": cluster.add_node(num_cpus=0, resources={"laneserve_prefill": 1}, object_store_memory=STORE),
                 "decode": cluster.add_node(num_cpus=0, resources={"laneserve_decode": 1}, object_store_memory=STORE)}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="laneserve-test", logging_level="warning")
        raysrv = Server("--ray-address", cluster.address, "--kv-tokens", "16384", "--heartbeat-timeout", "2",
                        "--max-restarts", "3")
        servers.append(raysrv)
        for s in (zmqsrv, raysrv):
            s.wait_ready()
        yield {"cluster": cluster, "nodes": nodes, "ray": raysrv, "zmq": zmqsrv}
    finally:
        for s in servers:
            s.interrupt()
        for s in servers:
            s.stop()
        ray.shutdown()
        cluster.shutdown()


def _complete(server: Server, prompt: str, **kw) -> str:
    out = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=kw.pop("max_tokens", 12),
                                             temperature=0, extra_body={"ignore_eos": True}, **kw)
    return out.choices[0].text


def _assert_no_kv_anywhere(server: Server) -> dict:
    """At rest: no request, every KV block free, no KV object held under a lease and no ObjectRef
    referenced by any instance actor (an object nobody references is freed by Ray)."""
    wait_all_free(server)

    def freed() -> dict | None:
        st = server.state()
        return st if all(i["kv_held"] == 0 and i["object_refs"] == 0 for i in st["instances"]) else None
    return wait_for(freed, 15, "KV objects freed")


def test_instances_run_on_the_nodes_offering_their_resource(env):
    st = env["ray"].state()
    where = {i["role"]: i["ray_node"] for i in st["instances"]}
    assert where == {"prefill": env["nodes"]["prefill"].node_id, "decode": env["nodes"]["decode"].node_id}
    assert all(i["status"] == "ready" for i in st["instances"])


def test_openai_greedy_outputs_identical_to_the_single_machine_deployment(env):
    raysrv, zmqsrv = env["ray"], env["zmq"]
    for prompt in PROMPTS:
        assert _complete(raysrv, prompt) == _complete(zmqsrv, prompt), prompt
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True})
    texts = [s.client().chat.completions.create(**chat).choices[0].message.content for s in (raysrv, zmqsrv)]
    assert texts[0] == texts[1]
    stream = raysrv.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == _complete(zmqsrv, PROMPTS[1])
    st = _assert_no_kv_anywhere(raysrv)
    assert st["in_flight"] == 0


def test_concurrent_requests_then_everything_is_freed(env):
    raysrv = env["ray"]
    expected = {p: _complete(env["zmq"], p, max_tokens=6) for p in PROMPTS}
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = _complete(raysrv, PROMPTS[i % len(PROMPTS)], max_tokens=6)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(got[i] == expected[PROMPTS[i % len(PROMPTS)]] for i in range(8))
    _assert_no_kv_anywhere(raysrv)


def test_a_disconnect_frees_kv_on_both_nodes(env):
    raysrv = env["ray"]
    for _ in range(3):
        with httpx.stream("POST", raysrv.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += bool(line)
                if lines == 3:
                    break                       # the client goes away mid-stream, on the decode node
    _assert_no_kv_anywhere(raysrv)
    assert all(i["restarts"] == 0 for i in raysrv.state()["instances"])


def test_the_decode_side_says_so_when_it_cannot_take_the_kv(env):
    """Through a real instance actor's lease table: a key that is gone (released, expired) and an
    owner that is gone each raise an error that says so, within the timeout; none waits."""
    host = ray.remote(InstanceHost).options(name="kv-owner-test", num_cpus=0, max_concurrency=2).remote()
    ray.get(host.node_id.remote(), timeout=60)
    transport = RayObjectTransport(owner="test-driver", timeout=5)
    desc = {"t": "ray", "owner": "kv-owner-test", "key": "no-such-key", "rid": 7, "shape": [2], "dtype": "float32",
            "n": 1}
    with pytest.raises(RuntimeError, match="request 7 .* is gone: its lease expired or it was released"):
        transport.get(desc)
    ray.kill(host)
    wait_for(lambda: ray.wait([host.node_id.remote()], timeout=0.5)[0], 30, "the owner actor's death")
    # a dead owner is detected and named (RuntimeError "cannot be fetched"), not waited out: running
    # into the transport's deadline would raise TimeoutError ("did not arrive within"), which fails here
    with pytest.raises(RuntimeError, match="request 7 .*cannot be fetched"):
        transport.get(desc)


def _referenced() -> set[bytes]:
    """Ids (hex) of the objects this driver holds a reference to."""
    return set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def test_the_owner_lets_go_of_every_object_it_put(env):
    """The prefill side's part of the ownership rule, in this driver: a put object stays referenced
    while its lease holds it, and the last reference goes on release or on lease expiry. Checked on
    the put objects' own ids (a count over all references would also see an earlier test's
    objects being let go meanwhile)."""
    import torch

    from laneserve.engine.kv_cache import KVPayload
    transport = RayObjectTransport(owner="test-driver", lease=0.3, leases=KVLeases())
    descs = [transport.put(i, KVPayload(4, torch.arange(64 * 1024, dtype=torch.float32))) for i in range(2)]
    ids = [transport.leases._held[d["key"]][0].hex().encode() for d in descs]   # no ref kept here
    assert transport.held() == 2 and set(ids) <= _referenced()
    transport.discard(descs[0])                   # an abort: released at once
    assert transport.held() == 1 and ids[0] not in _referenced() and ids[1] in _referenced()
    wait_for(lambda: transport.held() == 0, 10, "the lease to expire")
    assert not set(ids) & _referenced() and transport.leases.expired == 1


def test_sim_sweep_as_ray_tasks_is_identical_to_one_process(env, tmp_path):
    """``laneserve sim --ray-address``: the (policy x rate) grid and the goodput searches as Ray tasks
    on the cluster write the same table, byte for byte, and the same rows and metrics as one process."""
    from laneserve.cli import main
    args = ["sim", "--num-requests", "200", "--request-rate", "5,20", "--no-progress", "--goodput-search",
            "--policies", "fcfs+continuous,cp-edf-2k+continuous"]
    out = {}
    for name, extra in (("one", ["--jobs", "1"]), ("ray", ["--ray-address", env["cluster"].address])):
        assert main([*args, *extra, "--output", str(tmp_path / name)]) == 0
        data = json.loads((tmp_path / name / "sim.json").read_text())
        out[name] = (data["rows"], data["metrics"], (tmp_path / name / "sim.md").read_bytes())
    assert out["one"] == out["ray"]
    assert len(out["one"][0]) == 4 and set(out["one"][1]["goodput"]) == {"fcfs+continuous", "cp-edf-2k+continuous"}


def test_leases_expire_release_and_claim_once():
    leases = KVLeases()
    a, b, c = leases.hold("ref-a", 5.0), leases.hold("ref-b", 5.0), leases.hold("ref-c", 0.0)
    assert leases.claim(a) == ["ref-a"] and leases.claim(a) is None       # once
    assert leases.release(b) and not leases.release(b)
    assert leases.reap() == 1 and len(leases) == 0 and leases.expired == 1
    assert leases.claim(c) is None                                      # expired: gone


def test_decode_node_loss_fails_in_flight_requests_and_a_new_node_restores_service(env):
    raysrv, cluster = env["ray"], env["cluster"]
    errors: list[str] = []
    done = threading.Event()

    def stream() -> None:
        try:
            s = raysrv.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2000, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
            for _ in s:
                pass
            errors.append("finished without an error")
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            errors.append(str(exc))
        finally:
            done.set()
    streams = [threading.Thread(target=stream) for _ in range(2)]
    for t in streams:
        t.start()
    wait_for(lambda: any(i["role"] == "decode" and (i["running"] or 0) >= 2 for i in raysrv.state()["instances"]),
             30, "both streams decoding")
    cluster.remove_node(env["nodes"]["decode"])
    for t in streams:
        t.join(30)
    assert not any(t.is_alive() for t in streams), "a stream hangs after its decode node was lost"
    assert len(errors) == 2 and all("instance 1 (decode)" in e and "cancelled" in e for e in errors), errors
    health = httpx.get(raysrv.url + "/health", timeout=5).json()
    assert health["status"] == "unavailable" and "no decode instance" in health["message"]
    r = httpx.post(raysrv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503
    # a new node offering the resource: the restarted actor lands there, the server is not restarted
    env["nodes"]["decode"] = cluster.add_node(num_cpus=0, resources={"laneserve_decode": 1}, object_store_memory=STORE)
    wait_for(lambda: httpx.get(raysrv.url + "/health", timeout=5).json()["status"] == "ok", 120, "the new decode node")
    st = raysrv.state()
    dec = next(i for i in st["instances"] if i["role"] == "decode")
    assert dec["restarts"] >= 1 and dec["ray_node"] == env["nodes"]["decode"].node_id
    assert _complete(raysrv, PROMPTS[1]) == _complete(env["zmq"], PROMPTS[1])
    _assert_no_kv_anywhere(raysrv)
