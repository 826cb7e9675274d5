"""Instances as Ray actors across machines: ``laneserve serve --ray-address``.

The API/router process joins an existing Ray cluster as a driver and starts one actor per
instance. Placement is the operator's, with Ray's own tools: a prefill instance asks for one unit
of the custom node resource ``laneserve_prefill``, a decode instance ``laneserve_decode``, a
colocated one ``laneserve_colocated`` (``ray start --resources '{"laneserve_decode": 2}'`` makes a
node host two decode instances). Each actor hosts the unchanged instance loop
(:class:`~laneserve.cluster.worker.InstanceWorker`, or the stub), so the scheduler contract, the
policies and the router are the ones of :class:`~laneserve.cluster.process.ProcessCluster`, which
this class extends with three hooks only:

- control messages stay ZeroMQ, over TCP instead of unix sockets: the router binds its PULL socket
  and one PUSH socket per incarnation on its node's IP (random ports), the actors connect. The
  instance loop, its heartbeat thread and the router's read loop are reused as they are, with one
  hop per message (a Ray actor call per token batch would add a GCS-less but still heavier RPC
  and a second serialisation); Ray carries what Ray is good at — placement, process lifetime and
  the KV bytes (the ``ray`` transport of :mod:`laneserve.cluster.ray_kv`).
- ``_launch`` creates the actor; its handle (:class:`ActorProcess`) looks like a ``Popen`` to the
  supervisor: ``poll`` is "has the actor's ``serve`` call ended" (it ends when the loop stops, the
  actor dies or its node is lost), ``kill`` is ``ray.kill``. Heartbeats over TCP catch a lost node
  before Ray's own health checks do. A restart creates a new actor, which Ray places on any node
  offering the resource — a node that joins later included — without restarting the server.
- times: ``perf_counter`` clocks of different machines are unrelated, so the router ships its
  epoch as wall time and each actor converts it to its own ``perf_counter`` (machines with NTP).

What travels between nodes: requests, tokens, stats and heartbeats (msgpack over ZeroMQ/TCP, the
router's node <-> every instance), and each prefilled request's KV (prefill node -> decode node,
through the object stores).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import ray
import zmq

from laneserve.cluster.process import ClusterSpec, ProcessCluster
from laneserve.cluster.worker import WorkerSpec

RESOURCES = {"prefill": "laneserve_prefill", "decode": "laneserve_decode", "colocated": "laneserve_colocated"}
NAMESPACE = "laneserve"


class InstanceHost:
    """The body of an instance actor: ``serve`` runs the instance loop until it stops (one thread
    of a threaded actor); ``claim_kv`` / ``release_kv`` serve the KV this instance put for decode
    instances (other threads, concurrently with the loop)."""

    def serve(self, spec_json: str, wall_epoch: float, worker: str = "engine") -> int:
        spec = WorkerSpec.from_json(spec_json)
        spec.epoch = time.perf_counter() - (time.time() - wall_epoch)
        if worker == "stub":
            from laneserve.cluster.stub import StubWorker
            StubWorker(spec).serve()
            return 0
        threads = spec.engine.get("num_threads")
        if threads:
            import torch
            torch.set_num_threads(int(threads))
        from laneserve.cluster.worker import run_worker
        run_worker(spec)
        return 0

    def claim_kv(self, key: str) -> list | None:
        from laneserve.cluster.ray_kv import LEASES
        return LEASES.claim(key)

    def release_kv(self, key: str) -> bool:
        from laneserve.cluster.ray_kv import LEASES
        return LEASES.release(key)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def object_refs(self) -> int:
        """ObjectRefs this actor process references (Ray's reference table; no public API)."""
        return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


class ActorProcess:
    """An instance actor seen through the ``subprocess.Popen`` surface the supervisor uses."""

    def __init__(self, actor: Any, done: Any, name: str) -> None:
        self.actor = actor
        self.done = done                    # ObjectRef of the actor's ``serve`` call
        self.name = name
        self.returncode: int | None = None
        self.error: str | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = ray.wait([self.done], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(self.done))
                except ray.exceptions.RayError as exc:
                    self.returncode, self.error = 1, type(exc).__name__
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        ray.wait([self.done], timeout=timeout)
        return self.poll()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class RayCluster(ProcessCluster):
    def __init__(self, spec: ClusterSpec, address: str, *, log=None) -> None:
        if spec.in_process:
            raise ValueError("--ray-address runs instances as actors; --in-process does not apply")
        super().__init__(spec, log=log)
        self.address = address
        self.session = uuid.uuid4().hex[:8]
        self._host_ip = "127.0.0.1"
        self._connected = False

    async def start(self) -> None:
        if not ray.is_initialized():
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=True,
                     logging_level="warning")
            self._connected = True
        self._host_ip = ray.util.get_node_ip_address()
        offered = ray.cluster_resources()
        for role in {role for role, _ in self._roles()}:
            if offered.get(RESOURCES[role], 0) < 1:
                raise RuntimeError(f"no node of the Ray cluster at {self.address} offers {RESOURCES[role]!r}: "
                                   f"start one with ray start --address ... --resources "
                                   f"'{{\"{RESOURCES[role]}\": 1}}'")
        self.log(f"laneserve: joined the Ray cluster at {self.address} "
                 f"({len([n for n in ray.nodes() if n['Alive']])} nodes); control over tcp://{self._host_ip}")
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self._connected:
            ray.shutdown()
            self._connected = False

    def _instance_down(self, h) -> None:
        if h.exit_reason is None and h.proc.error:
            h.exit_reason = f"actor died: {h.proc.error}"
        super()._instance_down(h)

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{self._host_ip}")
        return f"tcp://{self._host_ip}:{port}"

    def _launch(self, wspec: WorkerSpec) -> ActorProcess:
        name = f"laneserve-{self.session}-{wspec.role}{wspec.instance_id}-g{wspec.gen}"
        actor = ray.remote(InstanceHost).options(
            name=name, resources={RESOURCES[wspec.role]: 1}, num_cpus=0, max_concurrency=4, max_restarts=0,
        ).remote()
        wall_epoch = time.time() - self.clock.now()
        return ActorProcess(actor, actor.serve.remote(wspec.to_json(), wall_epoch, self.spec.worker), name)

    def state(self) -> dict[str, Any]:
        """The process cluster's state, plus per instance the node it runs on and the ObjectRefs its
        actor process still references (owned or borrowed: 0 at rest, else the object store leaks)."""
        st = super().state()
        probes = {h.instance_id: (h.proc.actor.node_id.remote(), h.proc.actor.object_refs.remote())
                  for h in self.instances if h.accepting}
        for row in st["instances"]:
            node, refs = probes.get(row["id"], (None, None))
            row["ray_node"] = _get(node)
            row["object_refs"] = _get(refs)
        st["ray"] = {"address": self.address, "session": self.session}
        return st


def _get(ref: Any, timeout: float = 2.0) -> Any:
    """The value of ``ref``, or None if it does not come within ``timeout`` (a gauge never blocks long)."""
    if ref is None:
        return None
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayError:
        return None
