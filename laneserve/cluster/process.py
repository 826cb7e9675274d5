"""The router side of a multi-process deployment: launches one process per instance (or threads,
for the single-process colocated mode), talks to them over ZeroMQ, routes requests and KV
hand-offs, detects crashed instances and applies admission control.

Topology (all sockets bound here, workers connect): one PULL socket receives every instance's
messages; one PUSH socket per instance sends it ``add`` / ``transfer`` / ``abort`` / ``stop``. A
finished prefill comes back as a ``handoff`` (first token + KV descriptor); the decode router
picks a decode instance among the live ones and forwards it as a ``transfer``, so the router
always knows where each request is and can cancel it there.

Load figures for routers (``policies.routing.InstanceLoad``) are the instance's latest ``stats``
plus what was sent to it after that snapshot (``added`` counts the messages it processed), so
back-to-back arrivals do not all see the same stale figure.

Supervision: a monitor task watches every instance. A process that exits, or whose
heartbeats (sent by a thread of its own every 0.5 s, whatever the engine is doing) stop for
``heartbeat_timeout`` seconds — a hung or SIGSTOPped process — is down: it stops accepting, every
request on it fails with a clear error, its KV files are removed, a hung process is killed, and
the instance is restarted after a backoff (``restart_backoff`` doubling up to 30 s, at most
``max_restarts`` times; each restart is logged). A restarted process is a new incarnation
(``gen``) on a fresh inbox socket: late messages of the old one are ignored. While some instances
are down :meth:`health` says ``degraded``; requests get 503 only when no instance of a role is left.

Admission control: at most ``max_inflight`` requests in the system and ``max_queued_tokens``
prompt tokens waiting on prefill instances; beyond that :class:`Overloaded` (HTTP 429) with a
``retry_after`` estimated from the recent completion rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from laneserve.runtime.spec import InstanceSpec, PolicySpec
from laneserve.cluster.messages import (Abort, Add, EpochClock, Failed, Fatal, Handoff, InstanceInfo, Lane, Ready,
                                        RequestDesc, SampleStart, StartInfo, Stats, Stop, Tokens, Transfer, decode,
                                        WireSLO, encode)
from laneserve.cluster.transport import default_shm_dir, discard_descriptor
from laneserve.cluster.worker import WorkerSpec
from laneserve.core.prefix_summary import PrefixSummary
from laneserve.core.request import Phase, Request
from laneserve.core.sampling import SamplingParams
from laneserve.engine.config import EngineConfig
from laneserve.core.slo import SLO
from laneserve.runtime.cluster import (DEFAULT_DECODE_POLICY, DEFAULT_DECODE_ROUTER, DEFAULT_PREFILL_POLICY,
                                       DEFAULT_ROUTER, ClusterRuntime, Deployment, NoDestination, learned_step_model)
from laneserve.policies.routing import DecodeSummary

log = logging.getLogger("laneserve.cluster")

WORKER_MODULES = {"engine": "laneserve.cluster.worker", "stub": "laneserve.cluster.stub"}


class Overloaded(Exception):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    """No live instance can take the request."""


def _is_process(proc: Any) -> bool:
    """A Popen-like instance handle (a process or an actor), not an in-process thread."""
    return proc is not None and not isinstance(proc, threading.Thread)


@dataclass(slots=True)
class ClusterSpec:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    in_process: bool = False              # instances as threads of this process (colocated mode)
    #: typed policy specs, read once where they enter (the CLI: ``commands/serve.py``)
    prefill_policy: PolicySpec = field(default_factory=lambda: PolicySpec.parse("prefill", DEFAULT_PREFILL_POLICY))
    decode_policy: PolicySpec = field(default_factory=lambda: PolicySpec.parse("decode", DEFAULT_DECODE_POLICY))
    router: PolicySpec = field(default_factory=lambda: PolicySpec.parse("router", DEFAULT_ROUTER))
    decode_router: PolicySpec | None = None      # None: the decode policy's own (tpot-aware for adaptive)
    kv_tokens: int = 65536
    engine: dict[str, Any] = field(default_factory=dict)
    devices: tuple[str, ...] = ("cpu",)
    transport: str = "shm"
    worker: str = "engine"                # "engine" | "stub" (a measurement harness)
    stub_token_delay: float = 0.0
    max_inflight: int = 256
    max_queued_tokens: int | None = None
    startup_timeout: float = 180.0
    heartbeat_timeout: float = 10.0       # seconds without any message before an instance is hung
    max_restarts: int = 5                 # per instance; 0 = never restart
    #: ranks per instance (engine/tp): prefill and colocated instances, decode instances
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    restart_backoff: float = 0.5          # first restart delay (doubles per restart, at most 30 s)

    def __post_init__(self) -> None:
        """The policies arrive typed: a string here would be parsed again downstream."""
        kinds = {"prefill_policy": "prefill", "decode_policy": "decode", "router": "router", "decode_router": "router"}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if name == "decode_router" and value is None:
                continue
            if not isinstance(value, PolicySpec) or value.kind != kind:
                raise TypeError(f"ClusterSpec.{name} must be a {kind} PolicySpec (the CLI text read once with "
                                f"PolicySpec.parse), got {value!r}")

    @property
    def deployment(self) -> Deployment:
        """Topology, policies and routers, as every driver reads them (the cluster runtime's);
        a :class:`ProcessCluster` reads it once (this spec is mutable until then)."""
        return Deployment(mode="colocated" if self.colocated else "disaggregated", num_prefill=self.num_prefill,
                          num_decode=self.num_decode, prefill_policy=self.prefill_policy,
                          decode_policy=self.decode_policy, router=self.router,
                          decode_router=self.decode_router or DEFAULT_DECODE_ROUTER)

    def tensor_parallel_size(self, role: str) -> int:
        """The tensor-parallel degree of ``role``'s instances (colocated ones take the prefill degree)."""
        return self.decode_tensor_parallel_size if role == "decode" else self.prefill_tensor_parallel_size

    def instance_specs(self, deployment: Deployment) -> tuple[InstanceSpec, ...]:
        """Every instance of ``deployment``, sized by this spec and its engine options: devices
        given in turn, a decode-side instance the host pool ``num_host_blocks``, a colocated one
        the token budget ``max_num_batched_tokens``."""
        engine = {f.name: f.default for f in dataclass_fields(EngineConfig)} | self.engine
        host = engine["num_host_blocks"] * engine["block_size"]

        def sizes(role: str) -> dict[str, Any]:
            return {"kv_tokens": max(self.kv_tokens, engine["block_size"]),
                    "host_kv_tokens": 0 if role == "prefill" else host,
                    "token_budget": engine["max_num_batched_tokens"] if role == "colocated" else None,
                    "tensor_parallel_size": self.tensor_parallel_size(role)}
        return tuple(replace(spec, device=self.devices[i % len(self.devices)])
                     for i, spec in enumerate(deployment.instance_specs(sizes)))


@dataclass(slots=True)
class InstanceHandle:
    """One instance as the router sees it (satisfies ``policies.routing.InstanceLoad``)."""

    instance_id: int
    role: str
    policy: PolicySpec
    device: str
    sock: Any = None
    proc: Any = None                     # threading.Thread, or Popen-like (see ProcessCluster._launch)
    alive: bool = True
    ready: bool = False
    info: InstanceInfo | None = None     # from its Ready message
    load: Stats | None = None            # its latest stats (None: none since it started)
    sent: deque = field(default_factory=deque)    # (seq, prompt tokens) sent after the stats snapshot
    seq: int = 0
    exit_reason: str | None = None
    gen: int = 0                         # incarnation (restarts so far)
    last_seen: float = 0.0               # monotonic time of its last message
    restarting: bool = False
    spec: InstanceSpec | None = None     # what its process is started from (each incarnation)
    prefix: PrefixSummary | None = None  # what its prefix cache holds (from its kv_events)
    lane: str | None = None              # the length lane a pool router gave it (laps-pools)
    summary: DecodeSummary = field(default_factory=DecodeSummary)   # decode: its next step (stats)
    last_decode: tuple | None = None     # decode: its last pure decode step (a new tuple per step)
    decode_seq: int = -1                 # ...and that step's number

    @property
    def accepting(self) -> bool:
        return self.alive and self.ready

    @property
    def status(self) -> str:
        if self.accepting:
            return "ready"
        if self.restarting or (self.alive and not self.ready):
            return "starting"
        return "down"

    @property
    def stats(self) -> dict[str, Any]:
        """Its latest stats as a name -> value map (``/metrics``); empty before the first."""
        load = self.load
        return {} if load is None else {f: getattr(load, f) for f in load.__struct_fields__}

    def _pending(self) -> tuple[int, int]:
        added = self.load.added if self.load is not None else 0
        while self.sent and self.sent[0][0] <= added:
            self.sent.popleft()
        return len(self.sent), sum(t for _, t in self.sent)

    @property
    def queued_tokens(self) -> int:
        return (self.load.queued_tokens if self.load is not None else 0) + self._pending()[1]

    @property
    def num_waiting(self) -> int:
        return (self.load.waiting if self.load is not None else 0) + self._pending()[0]

    @property
    def num_running(self) -> int:
        return self.load.running if self.load is not None else 0

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage if self.load is not None else 0.0

    @property
    def busy_time(self) -> float:
        return self.load.busy if self.load is not None else 0.0

    def set_lane(self, lane: str) -> None:
        """Tell the instance its length lane (``laps-pools``); a restarted incarnation is told again."""
        self.lane = lane
        if self.alive and self.ready and self.sock is not None:
            self.sock.send(encode(Lane(lane)), copy=False)

    def decode_summary(self) -> DecodeSummary:
        """Its next decode step as of its last stats (requests offered since are not in it)."""
        return self.summary

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens of ``req`` its prefix cache holds, by the summary (0 without caching)."""
        return self.prefix.cached_tokens(req) if self.prefix is not None else 0

    def process_alive(self) -> bool:
        if isinstance(self.proc, threading.Thread):
            return self.proc.is_alive()
        return self.proc is not None and self.proc.poll() is None


class _InstanceThread(threading.Thread):
    """An in-process instance: what ended it, if it failed, is kept as one line (``failure``) for
    the start-up error, not printed as a thread traceback."""

    def __init__(self, body, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._body = body
        self.failure: str | None = None

    def run(self) -> None:
        try:
            self._body()
        except Exception as exc:  # noqa: BLE001 - reported by the cluster (start-up error, restart)
            self.failure = f"{type(exc).__name__}: {exc}"
            log.debug("instance thread %s failed", self.name, exc_info=True)


def _observe_start(req: Request, info: StartInfo | None, first_token: float | None) -> None:
    """Copy what the prefill side reports about ``req``'s start onto the router's copy (the
    router's policies read it: the ``laps-pools`` controller measures waits and TTFT deviations)."""
    times = req.times
    if times.first_token is not None:
        return
    if info is not None and info.prefill_start is not None:
        times.prefill_start = info.prefill_start
    times.first_token = first_token
    req.num_cached_tokens = info.cached if info is not None else 0


@dataclass(slots=True)
class Track:
    """A request in flight: where it is and where its events go."""

    rid: int
    request: Request
    events: asyncio.Queue
    stage: str = "prefill"                # prefill | decode | done
    instance: int = -1
    prefill_instance: int = -1
    aborted: bool = False
    kv: dict | None = None                # the KV descriptor sent to its decode instance
    # an n-sample request: the request ids of its samples, sample 0 first (its id is the one the
    # prefill instance knows until the first tokens are out); None for n = 1
    group: list[int] | None = None
    desc: RequestDesc | None = None       # what was sent to its prefill instance (and goes to decode)


@dataclass(slots=True)
class _Outgoing:
    """A hand-off on its way through the router: the tracks it carries (the samples still wanted
    of an n-sample request), the prefill instance's ``handoff`` and the samples' first tokens."""

    tracks: list[Track]
    handoff: Handoff
    samples: tuple[SampleStart, ...] | None


class _RouterLink:
    """The process cluster's KV link (:class:`~laneserve.runtime.cluster.KVLink`): the prefill
    instance exports its KV in its own process (``Instance.hand_off``: export to the transport,
    release) and sends the descriptor; the router forwards it in a ``transfer`` message."""

    def __init__(self, cluster: ProcessCluster) -> None:
        self.cluster = cluster

    def take(self, source: InstanceHandle, req: Request, now: float) -> _Outgoing:
        raise RuntimeError("a remote prefill instance exports its KV itself: the router forwards the handoff")

    def deliver(self, req: Request, dest: InstanceHandle, out: _Outgoing, now: float) -> None:
        msg = out.handoff
        for track in out.tracks:
            track.stage, track.instance, track.kv = "decode", dest.instance_id, msg.kv
        desc = out.tracks[0].desc or RequestDesc.describe(out.tracks[0].request)
        self.cluster._send(dest, encode(Transfer(desc, msg.out, msg.computed, msg.t_first, msg.kv, msg.info,
                                                 out.samples)), tokens=0)

    def discard(self, req: Request, out: _Outgoing) -> None:
        discard_descriptor(out.handoff.kv)


class ProcessCluster:
    def __init__(self, spec: ClusterSpec, *, log: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.clock = EpochClock()
        self.instances: list[InstanceHandle] = []
        self.tracks: dict[int, Track] = {}
        self._ids = itertools.count(1)
        self._completions: deque[float] = deque(maxlen=512)
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self.draining = False                 # set on shutdown: new requests get 503
        self.restarts = 0
        self.on_instance_down: Callable[[InstanceHandle], None] | None = None
        # admission, the hand-off and both routers: the cluster runtime's (the instances attach
        # once started); a decode router that predicts steps learns from the decode instances' own
        self.deployment = spec.deployment
        self.runtime = ClusterRuntime(self.deployment, _RouterLink(self),
                                      step_model=lambda: learned_step_model(spec.engine.get("attention")))

    @property
    def router(self):
        return self.runtime.router

    @property
    def decode_router(self):
        return self.runtime.decode_router

    # ---- topology ------------------------------------------------------------------------
    @property
    def front(self) -> list[InstanceHandle]:
        """Instances that take new requests (prefill or colocated)."""
        return [h for h in self.instances if h.role != "decode"]

    @property
    def decoders(self) -> list[InstanceHandle]:
        return [h for h in self.instances if h.role == "decode"]

    @property
    def limits(self) -> dict[str, int]:
        """What every request must fit: the smallest context length and KV capacity; and the
        decode side's KV in all (``decode_kv_tokens``: what one request may take a share of)."""
        ready = [h.info for h in self.instances if h.info is not None]
        kv = lambda info: info.kv_blocks * info.block_size  # noqa: E731
        decode_side = [info for info in ready if info.role != "prefill"]
        return {"max_model_len": min(info.max_model_len for info in ready),
                "kv_tokens": min(kv(info) for info in ready),
                "decode_kv_tokens": sum(kv(info) for info in decode_side) or min(kv(info) for info in ready),
                "vocab_size": min(info.vocab_size for info in ready)}

    def _roles(self) -> list[tuple[str, PolicySpec]]:
        return self.deployment.roles()

    # ---- start / stop ----------------------------------------------------------------------
    async def start(self) -> None:
        s = self.spec
        self.ctx = zmq.asyncio.Context()
        self.ipc_dir = Path(tempfile.mkdtemp(prefix="ls-", dir="/tmp"))
        self.kv_dir = Path(tempfile.mkdtemp(prefix="laneserve-kv-", dir=default_shm_dir()))
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self._outbox = self._bind(self.pull, "out")
        self._sync_ctx = zmq.Context() if s.in_process else None
        for i, ispec in enumerate(s.instance_specs(self.deployment)):
            h = InstanceHandle(i, ispec.role, ispec.policy, ispec.device, spec=ispec)
            self._spawn(h)
            self.instances.append(h)
        self.runtime.attach(self.front, self.decoders)
        self._tasks.append(asyncio.create_task(self._read_loop(), name="cluster-reader"))
        await self._wait_ready(self.instances)
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="cluster-monitor"))

    def _spawn(self, h: InstanceHandle) -> None:
        """Start incarnation ``h.gen`` of instance ``h`` on a fresh inbox socket."""
        s = self.spec
        if h.sock is not None:
            h.sock.close()
        h.sock = self.ctx.socket(zmq.PUSH)
        h.sock.setsockopt(zmq.LINGER, 0)
        inbox = self._bind(h.sock, f"in{h.instance_id}.{h.gen}")
        opts = {"token_delay": s.stub_token_delay} if s.worker == "stub" else {}
        wspec = WorkerSpec(instance_id=h.instance_id, instance=h.spec, model=str(s.model), inbox=inbox,
                           outbox=self._outbox, epoch=self.clock.epoch, transport=s.transport,
                           transport_dir=str(self.kv_dir), engine=dict(s.engine), policy_opts=opts, gen=h.gen)
        h.alive, h.ready, h.exit_reason = True, False, None
        h.load, h.sent, h.seq, h.prefix = None, deque(), 0, None
        h.last_seen = time.monotonic()
        h.proc = self._launch(wspec)

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind ``sock`` where the instances can reach it; the address they connect to. Here a
        unix socket under ``ipc_dir``; a deployment across machines binds TCP instead."""
        address = f"ipc://{self.ipc_dir}/{name}"
        sock.bind(address)
        return address

    def _launch(self, wspec: WorkerSpec):
        """Start one instance; the handle is a thread (in-process mode) or anything with the
        ``subprocess.Popen`` surface ``poll`` / ``kill`` / ``wait`` / ``returncode`` (a process,
        or a Ray actor in :mod:`laneserve.cluster.ray_cluster`)."""
        s = self.spec
        if s.in_process:
            if s.worker == "stub":
                from laneserve.cluster.stub import StubWorker
                body = lambda: StubWorker(wspec, self._sync_ctx).serve()  # noqa: E731
            else:
                from laneserve.cluster.worker import run_worker
                body = lambda: run_worker(wspec, self._sync_ctx)  # noqa: E731
            t = _InstanceThread(body, name=f"instance-{wspec.instance_id}")
            t.start()
            return t
        env = dict(os.environ)
        threads = s.engine.get("num_threads")
        if threads:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        # a session of its own: a terminal's Ctrl-C reaches the server, which stops the instances itself
        return subprocess.Popen([sys.executable, "-m", WORKER_MODULES[s.worker], wspec.to_json()], env=env,
                                start_new_session=True)

    async def _wait_ready(self, handles: list[InstanceHandle]) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout
        while not all(h.ready for h in handles):
            for h in handles:
                if not h.ready and (not h.process_alive() or h.exit_reason):
                    reason = h.exit_reason or getattr(h.proc, "failure", None) or "process exited"
                    raise RuntimeError(f"instance {h.instance_id} ({h.role}) failed to start: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances not ready after {self.spec.startup_timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.draining = True
        for h in self.instances:
            if h.alive and isinstance(h.proc, subprocess.Popen) and not h.ready and h.proc.poll() is None:
                # still loading (a shutdown during start-up): it holds no request, and would read the
                # Stop only once loaded, seconds from now; its files go with kv_dir below
                h.proc.kill()
            elif h.alive and h.process_alive():
                # bounded: a PUSH to an instance that never connected (it failed to start) waits for ever
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(h.sock.send(encode(Stop())), 1.0)
        deadline = time.monotonic() + 5.0
        for h in self.instances:
            while h.process_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if _is_process(h.proc) and h.proc.poll() is None:
                h.proc.kill()
                h.proc.wait(timeout=5)
        for t in self._tasks:
            t.cancel()
        for track in list(self.tracks.values()):
            self._fail(track, "server shutting down")
        for h in self.instances:
            if h.sock is not None:
                h.sock.close()
        if getattr(self, "pull", None) is not None:      # None when start() failed before binding it
            self.pull.close()
        # destroy, not term: a socket an in-process instance left open when it failed (it never
        # closed it) would make term() wait for ever
        self.ctx.destroy(linger=0)
        if self._sync_ctx is not None:
            self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        shutil.rmtree(self.kv_dir, ignore_errors=True)

    # ---- requests ----------------------------------------------------------------------------
    def admission(self, prompt_len: int) -> None:
        """Raise :class:`Overloaded` or :class:`Unavailable` when a new request must be refused."""
        s = self.spec
        if self.draining:
            raise Unavailable("the server is shutting down")
        front = [h for h in self.front if h.accepting]
        if not front:
            raise Unavailable("no prefill instance is available (all crashed or stopped)")
        if not s.colocated and not any(h.accepting for h in self.decoders):
            raise Unavailable("no decode instance is available (all crashed or stopped)")
        if len(self.tracks) >= s.max_inflight:
            raise Overloaded(f"server overloaded: {len(self.tracks)} requests in flight "
                             f"(limit {s.max_inflight})", self.retry_after(len(self.tracks) - s.max_inflight + 1))
        if s.max_queued_tokens is not None:
            queued = sum(h.queued_tokens for h in front)
            if queued + prompt_len > s.max_queued_tokens:
                raise Overloaded(f"server overloaded: {queued} prompt tokens queued "
                                 f"(limit {s.max_queued_tokens})", self.retry_after(1))

    def retry_after(self, excess: int) -> int:
        now = time.monotonic()
        recent = [t for t in self._completions if now - t < 10.0]
        rate = len(recent) / 10.0 if recent else 0.0
        return max(1, min(60, math.ceil(excess / rate))) if rate > 0 else 1

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, *, slo: SLO = SLO(),
               slo_class: str = "default", priority: int = 0, arrival: float | None = None) -> list[Track]:
        """Send a request to a prefill (or colocated) instance; one :class:`Track` per sample
        (``sampling.n`` of them: the prompt is prefilled once, for all of them)."""
        self.admission(len(prompt_ids))
        rids = [next(self._ids) for _ in range(sampling.n)]
        now = self.clock.now()
        desc = RequestDesc(rids[0], prompt_ids, sampling, now if arrival is None else arrival, WireSLO.of(slo),
                           slo_class, priority)
        req = desc.request()                  # the router's copy, for its policies
        h = self.runtime.admit(req, now)       # the prefill (or colocated) instance
        msg = encode(Add(desc, tuple(rids[1:])))   # may raise
        group = rids if len(rids) > 1 else None
        tracks = [Track(r, req, asyncio.Queue(), instance=h.instance_id, prefill_instance=h.instance_id, group=group,
                        desc=desc) for r in rids]
        for t in tracks:
            self.tracks[t.rid] = t
        self._send(h, msg, tokens=len(prompt_ids))
        return tracks

    def abort(self, rid: int) -> None:
        """Cancel ``rid`` on the instance that holds it (its KV is freed there)."""
        track = self.tracks.pop(rid, None)
        if track is None:
            return
        track.aborted = True
        track.request.phase = Phase.ABORTED
        if track.stage == "prefill" and track.group:
            # the prefill computes the prompt for every sample: it stops when none is wanted
            if any(r in self.tracks for r in track.group):
                return
            rid = track.group[0]
        h = self.instances[track.instance]
        if h.alive:
            self._send(h, encode(Abort((rid,))))

    def fail_all(self, message: str, status: int = 503) -> int:
        """End every request in flight with an error event (a drain past its deadline: streams
        get an SSE ``error`` event, complete answers a ``status``) and cancel it on its instance."""
        tracks = list(self.tracks.values())
        for track in tracks:
            self.abort(track.rid)
            self._fail(track, message, status)
        return len(tracks)

    def _send(self, h: InstanceHandle, data: bytes, tokens: int | None = None) -> None:
        """Send encoded message ``data`` to ``h``; ``tokens``: the prompt tokens of a request sent
        (counted as pending there until its stats say it came in)."""
        if tokens is not None:
            h.seq += 1
            h.sent.append((h.seq, tokens))
        # zmq.asyncio: queued at once, never blocks the loop
        h.sock.send(data, copy=False)

    def _fail(self, track: Track, message: str, status: int = 503) -> None:
        """End ``track`` with an error event; ``status`` is the HTTP status it maps to (503: the
        service failed it and a retry may succeed; 500: the engine failed on it; 400: its input)."""
        self.tracks.pop(track.rid, None)
        track.stage = "done"
        track.request.phase = Phase.ABORTED
        track.events.put_nowait(("err", message, status))

    def _remove_kv_files(self, rid: int) -> None:
        """KV files of ``rid`` nobody will read (its prefill or decode instance died)."""
        for path in self.kv_dir.glob(f"kv-{rid}-*"):
            path.unlink(missing_ok=True)

    # ---- instance messages -------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            data = await self.pull.recv()
            try:
                msg = decode(data)
                h = self.instances[msg.inst]
                if msg.gen != h.gen:
                    if isinstance(msg, Handoff):
                        discard_descriptor(msg.kv)
                    continue                  # a replaced incarnation's late message
                h.last_seen = time.monotonic()
                self._on_message(h, msg)
            except Exception as exc:  # noqa: BLE001 - a bad message must not kill the router
                self.log(f"laneserve: router error on a message from an instance: {exc!r}")

    def _on_message(self, h: InstanceHandle, msg) -> None:
        if isinstance(msg, Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, Handoff):
            self._on_handoff(h, msg)
        elif isinstance(msg, Stats):
            h.load = msg
            if msg.decode is not None:
                h.summary = msg.decode
                step = msg.last_decode
                if step is not None and step[4] != h.decode_seq:
                    h.last_decode, h.decode_seq = tuple(step[:4]), step[4]
            if h.prefix is not None:
                h.prefix.apply(msg.kv_events)
        elif isinstance(msg, Failed):
            self._on_failed(h, msg)
        elif isinstance(msg, Ready):
            info = h.info = msg.info
            h.prefix = PrefixSummary(info.block_size, info.prefix_root) if info.prefix_caching else None
            h.ready = True
            if h.lane is not None:
                h.set_lane(h.lane)
            self.log(f"laneserve: instance {h.instance_id} ({h.role}, {info.policy}, {info.device}) ready, "
                     f"pid {info.pid}")
        elif isinstance(msg, Fatal):
            h.exit_reason = msg.message

    def _on_tokens(self, msg: Tokens) -> None:
        for item in msg.items:
            track = self.tracks.get(item.rid)
            if track is None:
                continue
            if item.info is not None:
                _observe_start(track.request, item.info, self.clock.now())
            if item.finish is not None:
                self.tracks.pop(item.rid, None)
                track.stage = "done"
                track.request.phase = Phase.FINISHED
                self._completions.append(time.monotonic())
            elif track.stage == "prefill":       # colocated: the request (each sample) decodes here now
                track.stage = "decode"
            track.events.put_nowait(("tok", item.tokens, item.finish, item.logprobs,
                                     None if item.info is None else item.info.event()))

    def _on_failed(self, h: InstanceHandle, msg: Failed) -> None:
        status = 400 if msg.message.startswith("invalid request") else 500
        for rid in msg.rids:
            track = self.tracks.get(rid)
            if track is None:
                continue
            # a request failed before its first tokens fails each of its samples
            members = track.group if track.stage == "prefill" and track.group else [rid]
            for t in [self.tracks.get(r) for r in members]:
                if t is not None:
                    self._fail(t, f"instance {h.instance_id} ({h.role}): {msg.message}", status)

    def _on_handoff(self, src: InstanceHandle, msg: Handoff) -> None:
        if msg.samples is not None:
            return self._on_samples_handoff(src, msg)
        track = self.tracks.get(msg.rid)
        if track is None or track.aborted:
            discard_descriptor(msg.kv)
            return
        track.events.put_nowait(("tok", msg.out, None, msg.logprobs, msg.info.event()))
        _observe_start(track.request, msg.info, msg.t_first)
        self._transfer(src, [track], msg, None)

    def _on_samples_handoff(self, src: InstanceHandle, msg: Handoff) -> None:
        """The prefill of an n-sample request is done: each sample's first token goes to its track;
        the samples still wanted go to one decode instance with the one prompt KV."""
        going_on, samples = [], []
        for s in msg.samples:
            track = self.tracks.get(s.rid)
            if track is None:
                continue                          # aborted while the prompt was prefilled
            if s.finish is not None:
                self.tracks.pop(s.rid, None)
                track.stage = "done"
                self._completions.append(time.monotonic())
                track.request.phase = Phase.FINISHED
            else:
                going_on.append(track)
                samples.append(SampleStart(s.rid, s.index, s.token))
            _observe_start(track.request, msg.info, msg.t_first)
            track.events.put_nowait(("tok", [s.token], s.finish, s.logprobs, msg.info.event()))
        if not going_on:
            discard_descriptor(msg.kv)
            return
        self._transfer(src, going_on, msg, tuple(samples))

    def _transfer(self, src: InstanceHandle, tracks: list[Track], msg: Handoff,
                  samples: tuple[SampleStart, ...] | None) -> None:
        """The cluster runtime hands a finished prefill (``msg``: its handoff, the KV already
        exported by ``src``) and ``tracks`` off to a decode instance (:class:`_RouterLink` sends it)."""
        try:
            self.runtime.on_prefilled(tracks[0].request, src, self.clock.now(), _Outgoing(tracks, msg, samples))
        except NoDestination as exc:
            for track in tracks:
                self._fail(track, str(exc))

    async def _monitor_loop(self) -> None:
        timeout = self.spec.heartbeat_timeout
        while not self._closed:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for h in self.instances:
                if not h.alive or h.restarting or self._closed:
                    continue
                if not h.process_alive():
                    self._instance_down(h)
                elif h.ready and timeout > 0 and now - h.last_seen > timeout and not self.spec.in_process:
                    h.exit_reason = f"no heartbeat for {now - h.last_seen:.1f} s: hung, killed"
                    h.proc.kill()
                    self._instance_down(h)

    def _instance_down(self, h: InstanceHandle) -> None:
        h.alive = False
        h.load, h.prefix = None, None         # its gauges and cache no longer describe anything
        code = h.proc.returncode if _is_process(h.proc) else None
        h.exit_reason = h.exit_reason or f"exit code {code}"
        self.log(f"laneserve: instance {h.instance_id} ({h.role}) is down ({h.exit_reason}); "
                 "failing its requests and routing around it")
        for track in self.runtime.on_lost(h, list(self.tracks.values())):
            self._fail(track, f"instance {h.instance_id} ({h.role}) crashed ({h.exit_reason}); "
                              "the request was cancelled")
            self._remove_kv_files(track.rid)
            discard_descriptor(track.kv)      # KV the dead decode instance may not have taken yet
        if self.on_instance_down is not None:
            self.on_instance_down(h)
        if h.gen < self.spec.max_restarts and not self._closed:
            h.restarting = True
            self._tasks.append(asyncio.create_task(self._restart(h), name=f"restart-{h.instance_id}"))

    async def _restart(self, h: InstanceHandle) -> None:
        """Bring ``h`` back after a backoff; a start that fails counts as another crash."""
        delay = min(30.0, self.spec.restart_backoff * 2 ** h.gen)
        await asyncio.sleep(delay)
        if self._closed:
            return
        if _is_process(h.proc) and h.proc.poll() is None:
            h.proc.kill()
        h.gen += 1
        self.restarts += 1
        self.log(f"laneserve: restarting instance {h.instance_id} ({h.role}), restart {h.gen} of at most "
                 f"{self.spec.max_restarts} (after {delay:.1f} s)")
        self._spawn(h)
        try:
            await self._wait_ready([h])
        except (RuntimeError, TimeoutError) as exc:
            h.restarting = False
            h.exit_reason = f"restart failed: {exc}"
            if h.alive:
                if _is_process(h.proc) and h.proc.poll() is None:
                    h.proc.kill()
                self._instance_down(h)
            return
        h.restarting = False
        self.log(f"laneserve: instance {h.instance_id} ({h.role}) is back (restart {h.gen})")

    def health(self) -> dict[str, Any]:
        """``ok`` when every instance accepts, ``degraded`` when some are down or restarting but each
        role still has one, ``unavailable`` when a role has none (or the server is shutting down)."""
        insts = [{"id": h.instance_id, "role": h.role, "status": h.status, "restarts": h.gen,
                  **({"reason": h.exit_reason} if h.status != "ready" and h.exit_reason else {})}
                 for h in self.instances]
        try:
            self.admission(0)
        except Overloaded:
            pass                              # busy is not unhealthy
        except Unavailable as exc:
            return {"status": "unavailable", "message": str(exc), "instances": insts}
        return {"status": "ok" if all(h.accepting for h in self.instances) else "degraded", "instances": insts}

    # ---- introspection -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        s = self.spec
        return {"mode": "colocated" if s.colocated else "disaggregated", "worker": s.worker,
                "prefill_policy": str(s.prefill_policy), "decode_policy": str(s.decode_policy),
                "router": str(s.router),
                "decode_router": self.decode_router.name if self.decode_router is not None else None,
                # decode steps the router's online model has learned from (None: it reads none)
                "decode_router_steps": (self.decode_router.learner.observations
                                        if self.decode_router is not None and self.decode_router.learner is not None
                                        else None),
                "num_prefill": s.num_prefill,
                "host_kv_tokens": int(s.engine.get("num_host_blocks", 0)) * int(s.engine.get("block_size", 16)),
                "num_decode": 0 if s.colocated else s.num_decode, "kv_tokens": s.kv_tokens,
                "in_flight": len(self.tracks), "max_inflight": s.max_inflight, "restarts": self.restarts,
                "kv_files": sum(1 for _ in self.kv_dir.iterdir()) if self.kv_dir.is_dir() else 0,
                "instances": [{"id": h.instance_id, "role": h.role, "policy": str(h.policy),
                               "policy_options": h.policy.describe(), "device": h.device,
                               "tensor_parallel_size": h.spec.tensor_parallel_size,
                               "rank_pids": h.info.rank_pids if h.info is not None else None,
                               "alive": h.alive, "ready": h.ready, "status": h.status, "restarts": h.gen,
                               "pid": h.info.pid if h.info is not None else None,
                               "exit_reason": h.exit_reason,
                               **_load_state(h.load),
                               "prefix_blocks": len(h.prefix) if h.prefix is not None else None,
                               "lane": h.lane,
                               # decode: its pure decode steps reported to the router (tpot-aware)
                               "decode_steps_reported": h.decode_seq if h.decode_seq >= 0 else None}
                              for h in self.instances]}


def _load_state(load: Stats | None) -> dict[str, Any]:
    """An instance's latest stats, as the state endpoint shows them (None before the first)."""
    names = {"kv_free_blocks": "kv_free", "kv_total_blocks": "kv_total", "host_kv_free_blocks": "host_free",
             "host_kv_total_blocks": "host_total", "running": "running", "waiting": "waiting",
             "live_requests": "live", "preemptions": "preemptions", "kv_held": "kv_held", "kv_forks": "kv_forks",
             "steps": "steps"}
    return {shown: None if load is None else getattr(load, name) for shown, name in names.items()}
