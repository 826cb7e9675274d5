"""One engine instance in its own process (or thread), served over ZeroMQ.

The worker owns an :class:`~laneserve.engine.instance.EngineInstance` (the scheduler contract's
loop on tensors) and two sockets: a PULL socket it reads router messages from (a receiver thread
does only ``recv`` + :func:`~laneserve.cluster.messages.decode`, so a long step never delays
reading) and a PUSH socket for its outputs (used only by the main thread). The receiver thread
puts each ``add``'s request straight into the engine's
:class:`~laneserve.engine.instance.Inbox`, which the engine drains at every step and, through the
executor's preemption check, at every operator boundary, so an arrival during a preemptible
prefill is seen at once (FlowPrefill Algorithm 2); ``abort``, ``transfer``, ``lane`` and ``stop``
wait in a queue for the main thread, which handles them between steps.

After each step the worker sends one ``tok`` message with every request's new tokens (and
logprobs when asked for), hands finished prefills off (``export_kv`` -> KV transport ->
``handoff`` message, then ``scheduler.release``) and reports ``stats``. A decode worker reserves
blocks for an incoming transfer through the instance runtime (``offer_kv``, ``take_kv``), imports the KV
and adds the request, as :class:`~laneserve.cluster.local.LocalCluster` does in one process.

Failures stay with the request that caused them: a request whose message does not decode,
a transfer that fails, or a step that raises fails the requests involved (an ``err`` message; their
KV is freed) and the instance goes on. Only ``MAX_STEP_FAILURES`` failed steps in a row end the
process (its supervisor in the router restarts it). A heartbeat thread with its own socket says
"alive" every ``HEARTBEAT_INTERVAL`` seconds whatever the main loop is doing (a long step included),
so the router can tell a slow step from a hung or stopped process. Every message carries the
instance's incarnation ``gen``, so messages of a replaced process are ignored.

Run as ``python -m laneserve.cluster.worker SPEC_JSON``; :func:`run_worker` runs it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from laneserve.cluster.messages import (Abort, Add, EpochClock, Failed, Fatal, Handoff, Heartbeat, InstanceInfo,
                                        InvalidMessage, Lane, Ready, Report, RequestDesc, SampleFirst, SampleStart,
                                        StartInfo, Stats, Stop, TokenItem, Tokens, Transfer, decode, encode)
from laneserve.runtime.spec import InstanceSpec

STATS_INTERVAL = 0.05          # at most this often while busy
HEARTBEAT_INTERVAL = 0.5       # stats at least this often while idle; heartbeats this often always
MAX_STEP_FAILURES = 3          # failed steps in a row before the process gives up (and is restarted)


@dataclass(slots=True)
class WorkerSpec:
    """One instance process: its :class:`~laneserve.runtime.spec.InstanceSpec` (role, typed
    policy, sizes, device, TP degree; it crosses the spawn arguments whole and is built with
    :func:`~laneserve.runtime.build.build_instance`) and where it talks to the router."""

    instance_id: int
    instance: InstanceSpec
    model: str
    inbox: str                               # zmq address this worker PULLs from (router binds)
    outbox: str                              # zmq address this worker PUSHes to (router binds)
    epoch: float
    transport: str = "shm"
    transport_dir: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)   # EngineConfig fields
    policy_opts: dict[str, Any] = field(default_factory=dict)   # a stub worker's (token_delay)
    gen: int = 0                             # incarnation: the router ignores messages of older ones
    rank_launch: str = "process"             # how ranks 1..N-1 start: "process", or "ray" (actors, on Ray)

    @property
    def role(self) -> str:
        return self.instance.role

    @property
    def device(self) -> str:
        return self.instance.device

    @property
    def tensor_parallel_size(self) -> int:
        return self.instance.tensor_parallel_size

    def to_json(self) -> str:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return msgspec.json.encode({**d, "instance": self.instance.to_dict()}).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = msgspec.json.decode(text)
        return cls(**{**d, "instance": InstanceSpec.from_dict(d["instance"])})

    def connect(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """The instance's two sockets to the router: (PUSH to ``outbox``, PULL from ``inbox``)."""
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(self.outbox)
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.connect(self.inbox)
        return out, inbox

    def start_heartbeat(self, ctx: zmq.Context, stop: threading.Event) -> threading.Thread:
        """A daemon thread that sends a :class:`Heartbeat` every ``HEARTBEAT_INTERVAL`` s on its own
        socket (zmq sockets are not thread-safe) until ``stop`` is set."""
        def beat() -> None:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(self.outbox)
            msg = encode(Heartbeat(inst=self.instance_id, gen=self.gen))
            try:
                while not stop.is_set():
                    with contextlib.suppress(zmq.Again):
                        sock.send(msg, zmq.NOBLOCK)
                    stop.wait(HEARTBEAT_INTERVAL)
            except zmq.ZMQError:
                pass
            finally:
                sock.close()
        t = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{self.instance_id}")
        t.start()
        return t


class _RecordingExecutor:
    """The engine executor, remembering the last step's logprobs and n-sample first tokens
    (EngineInstance drops results)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_logprobs: dict | None = None
        self.last_forks: dict | None = None

    def execute(self, plan, should_stop=None):
        result = self.inner.execute(plan, should_stop)
        self.last_logprobs = getattr(result, "logprobs", None)
        self.last_forks = getattr(result, "forks", None)
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _SharedKV:
    """One prompt's KV, taken by each sample of an n-sample request: a transport descriptor
    (fetched once, on the first take) or a payload already here (colocated). Discarded once every
    sample took it or was dropped."""

    __slots__ = ("transport", "source", "payload", "users", "leader")

    def __init__(self, transport, source, users: int) -> None:
        self.transport, self.source, self.users = transport, source, users
        self.payload = None if isinstance(source, dict) else source
        self.leader: int | None = None       # the sample whose blocks the others fork (EngineInstance)

    def take(self):
        if self.payload is None:
            self.payload = get_kv(self.transport, self.source)
        return self._release(self.payload)

    def drop(self) -> None:
        self._release(None)

    def _release(self, value):
        self.users -= 1
        if self.users == 0:
            if self.payload is None:
                discard_kv(self.transport, self.source)
            self.source = self.payload = None
        return value


def put_kv(transport, rid: int, payload) -> Any:
    """``payload`` on the transport: one descriptor, the shards of a tensor-parallel group's
    export listed in a ``"sharded"`` one (``engine/tp/kv_reshard.py``)."""
    if hasattr(payload, "shards"):
        from laneserve.engine.tp.kv_reshard import put_sharded
        return put_sharded(transport, rid, payload)
    return transport.put(rid, payload)


def get_kv(transport, desc) -> Any:
    if isinstance(desc, dict) and desc.get("t") == "sharded":
        from laneserve.engine.tp.kv_reshard import get_sharded
        return get_sharded(transport, desc)
    return transport.get(desc)


def discard_kv(transport, desc) -> None:
    if isinstance(desc, dict) and desc.get("t") == "sharded":
        for shard in desc.get("shards", ()):
            transport.discard(shard)
        return
    transport.discard(desc)


def _rank_watchdog(spec: WorkerSpec, executor):
    """Should rank 0 stay blocked in a collective with a dead rank, stop the group and exit."""
    from laneserve.engine.tp.watchdog import RankWatchdog

    def gone(lost: str) -> None:
        print(f"laneserve: instance {spec.instance_id} ({spec.role}) lost a rank ({lost}) and is stuck in a "
              "step: stopping its ranks and exiting", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            executor.group.close(timeout_s=2.0)
        os._exit(1)
    return RankWatchdog(executor.group, gone).start()


class InstanceWorker:
    def __init__(self, spec: WorkerSpec, context: zmq.Context | None = None) -> None:
        self.spec = spec
        self.ctx = context or zmq.Context.instance()
        self.clock = EpochClock(spec.epoch)
        self.messages: queue.SimpleQueue = queue.SimpleQueue()   # router messages but adds, for the main thread
        self.wake = threading.Event()
        # the books, written by the receiver thread (adds) and the main thread: changed under _books
        self._books = threading.Lock()
        self.live: dict[int, Any] = {}        # rid -> Request, every request this instance holds
        self.sent: dict[int, int] = {}        # rid -> output tokens already sent
        self.kids: dict[int, tuple[int, ...]] = {}  # rid of an n-sample request -> ids of samples 1..n-1
        self.adds = 0                         # adds received (receiver thread)
        self.transfers = 0                    # transfers received (main thread)
        self.stopping = False
        self._last_stats = 0.0
        self._dirty = True
        self._last_decode: tuple | None = None       # the last decode step sent, and its number
        self._decode_seq = 0
        self.tp = None                        # the tensor-parallel executor (rank 0 of a group), if any
        self._watchdog = None                 # its RankWatchdog: a bound should rank 0 hang in a collective
        self.ready = False                    # Ready sent: a failure from now on is not a start-up failure

    # ---- set-up --------------------------------------------------------------------------
    def build(self) -> None:
        from laneserve.cluster.transport import make_transport
        from laneserve.engine.config import EngineConfig
        from laneserve.engine.instance import Inbox
        from laneserve.engine.resources import EngineResources
        from laneserve.runtime.build import build_instance

        spec = self.spec
        config = EngineConfig(**{"device": spec.device, **spec.engine})
        self.inbox = Inbox(self.clock)          # the receiver thread puts adds here (_accept)
        resources = EngineResources(spec.model, config, clock=self.clock, stop_checker=True, inbox=self.inbox,
                                    wrap_executor=_RecordingExecutor, rank_launch=spec.rank_launch)
        self.instance = build_instance(spec.instance_id, spec.instance, resources)
        scheduler, kv, inner = self.instance.scheduler, self.instance.scheduler.kv, self.instance.executor.inner
        model = inner.model
        if spec.tensor_parallel_size > 1:
            self.tp = inner
            if threading.current_thread() is threading.main_thread():   # its own process: it may exit
                self._watchdog = _rank_watchdog(spec, inner)
        self.transport = make_transport(spec.transport, directory=spec.transport_dir)
        self.info = InstanceInfo(
            max_model_len=model.config.max_position_embeddings, kv_blocks=kv.num_blocks, block_size=config.block_size,
            vocab_size=model.config.vocab_size, pid=os.getpid(),
            policy=scheduler.name if hasattr(scheduler, "name") else str(spec.instance.policy), role=spec.role,
            device=config.device, prefix_caching=kv.prefix_caching,
            prefix_root=kv.root if kv.prefix_caching else None, tensor_parallel_size=spec.tensor_parallel_size,
            rank_pids=list(inner.group.pids) if spec.tensor_parallel_size > 1 else None)
        if kv.prefix_caching:
            kv.allocator.record_events()   # the router's summary (core/prefix_summary.py)
        if spec.role == "decode":          # the tpot-aware decode router reads its last decode step
            self.instance.record_decode = True

    # ---- messages --------------------------------------------------------------------------
    def _receiver(self, sock: zmq.Socket) -> None:
        """The receiver thread: decode each router message; an ``add`` goes straight into the
        engine's inbox (:meth:`_accept`), where a running prefill's next operator boundary sees it;
        the rest (and messages that do not decode) wait for the main thread in ``messages``."""
        vocab = self.info.vocab_size
        try:
            while True:
                data = sock.recv()
                try:
                    msg = decode(data, vocab_size=vocab)
                except InvalidMessage as exc:
                    msg = exc
                if isinstance(msg, Add):
                    self._accept(msg)
                else:
                    if isinstance(msg, InvalidMessage) and msg.kind == "add":
                        self.adds += 1              # processed: failed by the main thread
                    self.messages.put(msg)
                self.wake.set()
                if isinstance(msg, Stop):
                    return
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError:
            return

    def _accept(self, add: Add) -> None:
        """A new request (receiver thread): book it, then hand it to the engine."""
        req = add.request.request()
        self._book(req, 0, add.kids)
        self.inbox.put(req)
        self.adds += 1

    def _book(self, req, sent: int, kids: tuple[int, ...] = ()) -> None:
        """``req`` is this worker's to report from now on, ``sent`` of its output tokens already
        sent; ``kids``: the request ids of its samples 1..n-1."""
        with self._books:
            self.live[req.request_id] = req
            self.sent[req.request_id] = sent
            if kids:
                self.kids[req.request_id] = kids

    def _handle_control(self) -> None:
        """The router messages other than adds, in arrival order (main thread, between steps)."""
        while True:
            try:
                msg = self.messages.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Abort):
                self.instance.take_arrivals()       # its add may still be in the inbox
                now = self.clock.now()
                for rid in msg.rids:
                    self._abort(rid, now)
                self._dirty = True
            elif isinstance(msg, Lane):
                self.instance.scheduler.set_lane(msg.lane)
            elif isinstance(msg, Transfer):
                self.transfers += 1
                self._dirty = True
                reqs = msg.requests()
                if msg.samples is not None:
                    self._fork_samples(reqs, msg.kv)
                else:
                    self._book(reqs[0], len(reqs[0].output_token_ids or ()))
                    self.instance.offer_kv(reqs[0], msg.kv)
            elif isinstance(msg, InvalidMessage):
                self._reject(msg)
            elif isinstance(msg, Stop):
                self.stopping = True

    def _reject(self, exc: InvalidMessage) -> None:
        """A router message that did not decode: fail the requests it names, discard its KV."""
        if exc.kind == "transfer":
            self.transfers += 1
            if isinstance(exc.kv, dict):
                self.transport.discard(exc.kv)
        print(f"laneserve: instance {self.spec.instance_id}: invalid message: {exc}", file=sys.stderr, flush=True)
        if exc.rids:
            self._send(Failed(exc.rids, f"invalid request: {exc}"))

    def _fork_samples(self, reqs: list, kv: Any) -> None:
        """The samples of an n-sample request (``reqs``, from :meth:`Transfer.requests`) take its one
        prompt KV (``kv``: a transport descriptor, or a payload here): each is offered to the
        instance with a share of ``kv``.

        The KV is fetched once; the first sample admitted imports it and the others share its full
        prompt blocks (``EngineInstance._share_prompt``: a refcounted fork of its table, the partial
        last block copied), or import their own copy when the leader no longer holds them."""
        shared = _SharedKV(self.transport, kv, len(reqs))
        for req in reqs:
            self._book(req, 1)
            self.instance.offer_kv(req, shared)

    def _fetch(self, payload):
        return payload.take() if isinstance(payload, _SharedKV) else get_kv(self.transport, payload)

    def _discard(self, payload) -> None:
        if isinstance(payload, _SharedKV):
            payload.drop()
        else:
            discard_kv(self.transport, payload)

    def _fail_step(self, exc: BaseException) -> None:
        """A step raised: fail the requests of the plan it ran (their KV is freed), keep serving."""
        plan = self.instance.plan
        rids = [] if plan is None else [c.request.request_id for c in plan.prefills] + [
            r.request_id for r in plan.decodes]
        now = self.clock.now()
        for rid in rids:
            with contextlib.suppress(Exception):
                self.instance.scheduler.abort(rid, now)
        with contextlib.suppress(Exception):
            self.instance.executor.discard(plan)
        self.instance.plan = None
        print(f"laneserve: instance {self.spec.instance_id}: step failed ({type(exc).__name__}: {exc}); "
              f"failing request(s) {rids}", file=sys.stderr, flush=True)
        if rids:
            self._fail(rids, f"the engine step failed: {type(exc).__name__}: {exc}")

    def _fail_rows(self, failed: dict[int, str]) -> None:
        """Requests whose logits row could not be sampled (the instance aborted them): tell the router."""
        for rid, why in failed.items():
            self._fail([rid], f"sampling failed: {why}")

    def _forget(self, rid: int) -> None:
        """``rid`` is no longer this worker's to report (finished, handed off, failed or aborted)."""
        with self._books:
            self.live.pop(rid, None)
            self.sent.pop(rid, None)
            self.kids.pop(rid, None)

    def _fail(self, rids: list[int], message: str) -> None:
        """These requests failed here (their KV already freed): forget them and tell the router."""
        for rid in rids:
            self._forget(rid)
        self._send(Failed(tuple(rids), message))

    def _abort(self, rid: int, now: float) -> None:
        self._forget(rid)
        _, desc = self.instance.abort(rid, now)
        if desc is not None:                    # its KV had not come in yet
            self._discard(desc)

    def _take_transfers(self) -> None:
        def failed(req, exc: Exception) -> None:
            self._fail([req.request_id], f"KV transfer failed: {exc}")

        def never_fits(req, desc) -> None:
            self._discard(desc)
            self._fail([req.request_id], "the request can never fit this decode instance's KV memory")
        self.instance.take_kv(self._fetch, on_error=failed, on_drop=never_fits)

    # ---- outputs -----------------------------------------------------------------------------
    def _send(self, msg: Report) -> None:
        self.out.send(encode(msg.sent_by(self.spec.instance_id, self.spec.gen)))

    def _emit(self, outcome) -> None:
        lps = self.instance.executor.last_logprobs or {}
        finished = {r.request_id: r for r in outcome.finished}
        handoffs = [r for r in outcome.prefilled] if self.spec.role == "prefill" else []
        handed = {r.request_id for r in handoffs}
        items = []
        samples = self._first_samples(lps)
        for rid, group in samples.items():
            if rid not in handed:
                items += self._settle_samples(self.live[rid], group, finished)
        with self._books:
            live = list(self.live.items())
        for rid, req in live:
            if rid in handed:
                continue
            out = req.output_token_ids or ()
            sent = self.sent[rid]
            fin = finished.get(rid)
            if len(out) <= sent and fin is None:
                continue
            new = list(out[sent:])
            self.sent[rid] = len(out)
            lp = _logprobs(lps.get(rid)) if new and req.sampling.logprobs is not None else None
            info = None
            if fin is not None or sent == 0:
                plp = (req.prompt_logprobs or []) if sent == 0 and req.sampling.prompt_logprobs is not None else None
                info = StartInfo(req.times.prefill_start, preemptions=req.num_preemptions,
                                 cached=req.num_cached_tokens, prompt_logprobs=plp)
            items.append(TokenItem(rid, new, fin.finish_reason if fin is not None else None, lp, info))
            if fin is not None:
                self._forget(rid)
        if items:
            self._send(Tokens(tuple(items)))
        for req in handoffs:
            self._hand_off(req, lps.get(req.request_id), samples.get(req.request_id))

    def _first_samples(self, lps: dict) -> dict[int, list[SampleFirst]]:
        """The first tokens of the n-sample requests that sampled them this step: rid -> a
        :class:`SampleFirst` for each sample 0..n-1 (sample 0 = the request)."""
        from laneserve.engine.sampler import token_stops

        forks = self.instance.executor.last_forks or {}
        eos = self.instance.executor.eos_token_ids
        out = {}
        for rid, extra in forks.items():
            req = self.live.get(rid)
            if req is None or not req.output_token_ids:
                continue
            firsts = [(req.output_token_ids[0], lps.get(rid)), *extra]
            group = []
            for k, (sample_rid, (token, lp)) in enumerate(zip([rid, *self.kids.pop(rid, ())], firsts)):
                params = req.sampling.sample(k)
                finish = "stop" if token_stops(token, params, eos) else "length" if req.max_output_tokens <= 1 else None
                group.append(SampleFirst(sample_rid, k, token, finish,
                                         _logprobs(lp) if params.logprobs is not None else None))
            out[rid] = group
        return out

    def _settle_samples(self, req, group: list[SampleFirst], finished: dict) -> list[TokenItem]:
        """An n-sample request that sampled its first tokens here and is not handed off: the samples
        that go on take its prompt KV on this instance (colocated); sample 0 ends if its first token
        ends it. Returns the ``tok`` items of samples 1..n-1 (sample 0's item is the request's own)."""
        rid = req.request_id
        info = StartInfo(req.times.prefill_start, preemptions=req.num_preemptions)
        fin = finished.get(rid)
        going_on = tuple(SampleStart(s.rid, s.index, s.token) for s in group[1:] if s.finish is None)
        if fin is None and going_on:
            payload = self.instance.executor.export_kv(rid, req.num_computed_tokens)
            here = Transfer(RequestDesc.describe(req), [], req.num_computed_tokens, req.times.first_token,
                            info=StartInfo(req.times.prefill_start), samples=going_on)
            self._fork_samples(here.requests(), payload)
        if fin is None and group[0].finish is not None:           # sample 0's first token ended it
            self.instance.scheduler.abort(rid, self.clock.now(), reason=group[0].finish)
            finished[rid] = req
        elif fin is not None and fin.finish_reason == "length" and group[0].finish is not None:
            req.finish_reason = group[0].finish                    # EOS as the one token: "stop", as for n=1
        return [TokenItem(s.rid, [s.token], s.finish if s.finish is not None or fin is None else fin.finish_reason,
                          s.logprobs, info) for s in group[1:]]

    def _hand_off(self, req, lp, samples: list[SampleFirst] | None = None) -> None:
        """A finished prefill goes to the router (a ``handoff``) with its KV (exported by :meth:`_export`)."""
        desc = self._export(req)
        if desc is not None:
            t = req.times
            plp = (req.prompt_logprobs or []) if req.sampling.prompt_logprobs is not None else None
            self._send(Handoff(req.request_id, list(req.output_token_ids or ()), req.num_computed_tokens, desc,
                               t.first_token, _logprobs(lp) if req.sampling.logprobs is not None else None,
                               StartInfo(t.prefill_start, t.prefill_end, req.num_preemptions,
                                         req.num_cached_tokens, plp),
                               None if samples is None else tuple(samples)))
        self._forget(req.request_id)

    def _export(self, req) -> Any:
        """Put ``req``'s KV on the transport and release it from the scheduler; the transport's
        descriptor, or None after failing the request (the export failed)."""
        rid = req.request_id
        inst = self.instance
        try:          # the prefill side of the hand-off (the router's runtime does the rest)
            return inst.hand_off(req, lambda r: put_kv(
                self.transport, rid, inst.executor.export_kv(rid, r.num_computed_tokens)))
        except Exception as exc:  # noqa: BLE001
            inst.scheduler.abort(rid, self.clock.now())
            self._fail([rid], f"KV export failed: {exc}")
            return None

    def _stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < (STATS_INTERVAL if self._dirty else HEARTBEAT_INTERVAL):
            return
        inst = self.instance
        sched = inst.scheduler
        kv = sched.kv
        host = sched.host_pool
        decode, last_decode = self._decode_figures() if inst.role == "decode" else (None, None)
        # an add counts once received: those still in the inbox wait too
        self._send(Stats(added=self.adds + self.transfers, waiting=inst.num_waiting + len(self.inbox),
                         running=inst.num_running,
                         queued_tokens=inst.queued_tokens, kv_usage=kv.usage, kv_free=kv.num_free_blocks,
                         kv_total=kv.num_blocks, host_free=host.num_free_blocks if host is not None else None,
                         host_total=host.num_blocks if host is not None else None,
                         preemptions=inst.total_preemptions, prefix_queries=kv.query_tokens,
                         prefix_hits=kv.hit_tokens, steps=inst.steps, busy=inst.busy_time, live=len(self.live),
                         incoming=len(inst.pending), kv_held=self.transport.held(),
                         kv_events=kv.allocator.take_events(), kv_forks=inst.kv_forks,
                         decode=decode, last_decode=last_decode))
        self._last_stats = now
        self._dirty = False

    def _decode_figures(self) -> tuple:
        """What the server's decode router reads (``tpot-aware``): the summary of the next step and
        the last completed pure decode step, numbered so the router learns from each step once."""
        inst = self.instance
        step = inst.last_decode
        if step is not None and step is not self._last_decode:
            self._last_decode, self._decode_seq = step, self._decode_seq + 1
        return inst.decode_summary(), ((*step, self._decode_seq) if step is not None else None)

    # ---- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        self.out, inbox = self.spec.connect(self.ctx)
        try:
            self.build()
        except Exception as exc:  # noqa: BLE001 - report, then die
            self._close_ranks()
            self._send(Fatal(f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
            raise
        self._beat_stop = threading.Event()
        self.spec.start_heartbeat(self.ctx, self._beat_stop)
        receiver = threading.Thread(target=self._receiver, args=(inbox,), daemon=True,
                                    name=f"recv-{self.spec.instance_id}")
        receiver.start()
        self._send(Ready(self.info))
        self.ready = True
        try:
            self._loop()
        except Exception as exc:
            self._going_down(exc)
            raise
        finally:
            self._beat_stop.set()
            self._close_ranks()
            self.out.close()
            inbox.close()

    def _close_ranks(self) -> None:
        """Stop the other ranks of a tensor-parallel instance (killed if one of them is already
        gone): no rank outlives its instance, whatever ends it."""
        if self._watchdog is not None:
            self._watchdog.disarm()
        if self.tp is not None:
            with contextlib.suppress(Exception):
                self.tp.close()

    def _going_down(self, exc: BaseException) -> None:
        """A tensor-parallel instance that lost a rank fails what it holds with that reason (the
        router would only see the process exit) and tells the router why it goes down."""
        if self.tp is None or not self.tp.group.lost():
            return
        if self._watchdog is not None:
            self._watchdog.disarm()
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        with self._books:
            rids = list(self.live)
        with contextlib.suppress(Exception):
            if rids:
                self._fail(rids, f"the instance went down: {why}")
            self._send(Fatal(why))

    def _check_ranks(self) -> None:
        """A tensor-parallel instance whose rank died goes down as a whole (its supervisor restarts
        the group): :class:`~laneserve.engine.tp.executor.RankLost` ends the loop."""
        if self.tp is not None:
            self.tp.check_ranks()

    def _loop(self) -> None:
        inst = self.instance
        parent = os.getppid()
        failures = 0
        while not self.stopping:
            self._check_ranks()
            self._handle_control()
            if self.stopping:
                break
            self._take_transfers()
            try:
                outcome = inst.step()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - fail the step's requests, not the instance
                failures += 1
                self._fail_step(exc)
                self._dirty = True
                if failures >= MAX_STEP_FAILURES or (self.tp is not None and self.tp.group.lost()):
                    raise
                continue
            if outcome is None:
                if os.getppid() != parent:      # the router died: nobody is listening
                    break
                self._stats()
                due, wake = inst.next_due(), inst.scheduler.next_wakeup()
                now = self.clock.now()
                timeout = min([STATS_INTERVAL if self._dirty else HEARTBEAT_INTERVAL,
                               *(max(0.0, t - now) for t in (due, wake) if t is not None)])
                if self.messages.empty():
                    self.wake.wait(timeout)
                self.wake.clear()
                continue
            self._dirty = True
            self._fail_rows(inst.failed)
            self._emit(outcome)
            self._stats()


def _logprobs(lp) -> list | None:
    if lp is None:
        return None
    return [[float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]]]


def run_worker(spec: WorkerSpec, context: zmq.Context | None = None) -> None:
    InstanceWorker(spec, context).serve()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(argv[0])
    threads = spec.engine.get("num_threads")
    if threads:
        import torch
        torch.set_num_threads(int(threads))
    worker = InstanceWorker(spec)
    try:
        worker.serve()
    except Exception as exc:  # noqa: BLE001 - the router reports it; one line here, not a traceback
        print(f"laneserve: instance {spec.instance_id} ({spec.role}) failed{'' if worker.ready else ' to start'}: "
              f"{type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1 if worker.ready else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

