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
- a tensor-parallel instance gets one placement group of N bundles, one device each (a GPU on
  CUDA, a CPU elsewhere; bundle 0 also holds the role's resource), packed on one node; its actor
  runs in bundle 0 as rank 0 (the runtime and the scheduler, as locally) and starts ranks
  1..N-1 as actors in the other bundles (:mod:`laneserve.engine.tp.ray_ranks`). The group goes
  with the instance: removed when its actor's ``serve`` ends or it is killed, which ends the rank
  actors too.
- times: ``perf_counter`` clocks of different machines are unrelated, so the router ships its
  epoch as wall time and each actor converts it to its own ``perf_counter`` (machines with NTP).

What travels between nodes: requests, tokens, stats and heartbeats (msgpack over ZeroMQ/TCP, the
router's node <-> every instance), and each prefilled request's KV (prefill node -> decode node,
through the object stores).
"""

from __future__ import annotations

import dataclasses

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

    def __init__(self, actor: Any, done: Any, name: str, placement_group: Any = None) -> None:
        self.actor = actor
        self.done = done                    # ObjectRef of the actor's ``serve`` call
        self.name = name
        self.placement_group = placement_group   # a TP instance's bundles (its ranks' devices)
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
                self._remove_placement_group()
        return self.returncode

    def _remove_placement_group(self) -> None:
        """The instance is over: free its bundles (Ray ends the actors still in them)."""
        if self.placement_group is not None:
            pg, self.placement_group = self.placement_group, None
            ray.util.remove_placement_group(pg)

    def wait(self, timeout: float | None = None) -> int | None:
        ray.wait([self.done], timeout=timeout)
        return self.poll()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)
        self._remove_placement_group()


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
        self._check_rank_devices(offered)
        self.log(f"laneserve: joined the Ray cluster at {self.address} "
                 f"({len([n for n in ray.nodes() if n['Alive']])} nodes); control over tcp://{self._host_ip}")
        await super().start()

    def _check_rank_devices(self, offered: dict) -> None:
        """A TP instance's placement group needs its degree of devices on one node: refuse a
        cluster offering fewer in all (Ray would leave the instance pending for ever)."""
        from laneserve.engine.tp.ray_ranks import device_resource
        device = self.spec.devices[0] if self.spec.devices else "cpu"
        (kind, _), = device_resource(device).items()
        for role in {role for role, _ in self._roles()}:
            tp = self.spec.tensor_parallel_size(role)
            if tp > 1 and offered.get(kind, 0) < tp:
                raise RuntimeError(f"a {role} instance at tensor parallel size {tp} needs {tp} {kind} on one "
                                   f"node; the Ray cluster at {self.address} offers {offered.get(kind, 0):g}")

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
        options = dict(name=name, resources={RESOURCES[wspec.role]: 1}, num_cpus=0, max_concurrency=4,
                       max_restarts=0)
        pg = None
        if wspec.tensor_parallel_size > 1:
            pg = self._rank_placement(wspec, name, options)
        actor = ray.remote(InstanceHost).options(**options).remote()
        wall_epoch = time.time() - self.clock.now()
        return ActorProcess(actor, actor.serve.remote(wspec.to_json(), wall_epoch, self.spec.worker), name, pg)

    @staticmethod
    def _rank_placement(wspec: WorkerSpec, name: str, options: dict) -> Any:
        """A TP instance's placement group (one device per rank, on one node); ``options`` and
        ``wspec`` are updated so the instance actor runs in bundle 0 and starts its ranks in the
        others. Ray queues the actor until the group is placed."""
        from laneserve.engine.tp.ray_ranks import actor_resources, in_bundle, instance_placement_group
        pg = instance_placement_group(wspec.tensor_parallel_size, wspec.device, options["resources"], f"{name}-tp")
        options.update(actor_resources(wspec.device), **in_bundle(pg, 0))
        wspec.rank_launch = "ray"
        if wspec.device.startswith("cuda"):
            # Ray shows each rank actor only its bundle's GPU
            wspec.instance = dataclasses.replace(wspec.instance, device="cuda:0")
        return pg

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
        pgs = {h.instance_id: h.proc.placement_group for h in self.instances if h.proc is not None}
        for row in st["instances"]:
            pg = pgs.get(row["id"])
            row["placement_group"] = pg.id.hex() if pg is not None else None
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
