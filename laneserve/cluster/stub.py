"""A STUB instance — a measurement and test harness, not an engine.

It speaks the instance protocol of :mod:`laneserve.cluster.messages` (the engine instances' message
types and codec) without a model: every output token is the prompt's tokens echoed cyclically.
With ``token_delay = 0`` it answers at once (all tokens in one message), so a benchmark against it
measures only the API + router + messaging overhead (``benchmarks/serve_overhead.py``). With a
delay it emits one token per delay, so tests can hold requests in flight (disconnects, crashed
instances) without loading torch.

A stub prefill instance sends its first token in a ``handoff`` with no KV (``kv`` = None);
a stub decode instance continues from there. KV figures in its stats are fake (blocks = tokens
held / 16), enough for the router and the state endpoint.

Run as ``python -m laneserve.cluster.stub SPEC_JSON`` (a :class:`~laneserve.cluster.worker.WorkerSpec`
whose ``policy_opts`` may hold ``token_delay`` in seconds).
"""

from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from laneserve.cluster.messages import (Abort, Add, EpochClock, Handoff, InstanceInfo, InvalidMessage, Ready,
                                        Report, StartInfo, Stats, Stop, TokenItem, Tokens, Transfer, decode, encode)
from laneserve.cluster.worker import WorkerSpec

MAX_MODEL_LEN = 4096
KV_BLOCKS = 4096
BLOCK = 16


@dataclass(slots=True)
class _Held:
    prompt: list[int]
    max_tokens: int
    n: int                                   # output tokens so far


class StubWorker:
    def __init__(self, spec: WorkerSpec, context: zmq.Context | None = None) -> None:
        self.spec = spec
        self.ctx = context or zmq.Context.instance()
        self.clock = EpochClock(spec.epoch)
        self.delay = float(spec.policy_opts.get("token_delay", 0.0))
        self.reqs: dict[int, _Held] = {}
        self.timers: list[tuple[float, int]] = []
        self.added = 0
        self.out_items: list[TokenItem] = []

    def _send(self, msg: Report) -> None:
        self.out.send(encode(msg.sent_by(self.spec.instance_id, self.spec.gen)))

    def _advance(self, rid: int, now: float) -> None:
        """Produce the next token(s) of ``rid`` (all of them when there is no delay)."""
        r = self.reqs.get(rid)
        if r is None:
            return
        count = r.max_tokens - r.n if self.delay <= 0 else 1
        if self.spec.role == "prefill":
            count = 1
        toks = []
        for _ in range(count):
            toks.append(int(r.prompt[r.n % len(r.prompt)]))
            r.n += 1
        done = r.n >= r.max_tokens
        if self.spec.role == "prefill" and not done:
            del self.reqs[rid]
            self._send(Handoff(rid, toks, len(r.prompt), None, now, info=StartInfo(now, now)))
            return
        info = StartInfo(now) if r.n == len(toks) else None
        self.out_items.append(TokenItem(rid, toks, "length" if done else None, None, info))
        if done:
            del self.reqs[rid]
        else:
            heapq.heappush(self.timers, (now + self.delay, rid))

    def _handle(self, msg, now: float) -> bool:
        if isinstance(msg, (Add, Transfer)):
            desc = msg.request
            out = msg.out if isinstance(msg, Transfer) else ()
            self.reqs[desc.rid] = _Held(desc.prompt, desc.sampling.max_tokens, len(out))
            self.added += 1
            if isinstance(msg, Add) or self.delay <= 0:
                self._advance(desc.rid, now)
            else:
                heapq.heappush(self.timers, (now + self.delay, desc.rid))
        elif isinstance(msg, Abort):
            for rid in msg.rids:
                self.reqs.pop(rid, None)
        elif isinstance(msg, Stop):
            return False
        return True

    def _stats(self) -> None:
        held = sum(len(r.prompt) + r.n for r in self.reqs.values())
        used = -(-held // BLOCK)
        self._send(Stats(added=self.added, running=len(self.reqs), kv_usage=used / KV_BLOCKS,
                         kv_free=KV_BLOCKS - used, kv_total=KV_BLOCKS, live=len(self.reqs)))

    def serve(self) -> None:
        self.out, inbox = self.spec.connect(self.ctx)
        self._send(Ready(InstanceInfo(max_model_len=MAX_MODEL_LEN, kv_blocks=KV_BLOCKS, block_size=BLOCK,
                                      vocab_size=1 << 20, pid=os.getpid(), policy="stub", role=self.spec.role,
                                      device="none", stub=True)))
        beat_stop = threading.Event()
        self.spec.start_heartbeat(self.ctx, beat_stop)
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        last_stats = 0.0
        running = True
        parent = os.getppid()
        try:
            while running and os.getppid() == parent:
                now = self.clock.now()
                timeout = 200.0
                if self.timers:
                    timeout = max(0.0, (self.timers[0][0] - now) * 1000.0)
                if poller.poll(timeout):
                    while running:
                        try:
                            data = inbox.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            running = self._handle(decode(data, vocab_size=1 << 20), self.clock.now())
                        except InvalidMessage as exc:
                            print(f"laneserve: stub instance {self.spec.instance_id}: invalid message: {exc}",
                                  file=sys.stderr, flush=True)
                now = self.clock.now()
                while self.timers and self.timers[0][0] <= now:
                    _, rid = heapq.heappop(self.timers)
                    self._advance(rid, now)
                if self.out_items:
                    self._send(Tokens(tuple(self.out_items)))
                    self.out_items = []
                if time.monotonic() - last_stats > 0.05:
                    self._stats()
                    last_stats = time.monotonic()
        finally:
            beat_stop.set()
            self.out.close()
            inbox.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    StubWorker(WorkerSpec.from_json(argv[0])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
