"""The instance protocol's codec (``cluster/messages.py``): every message kind survives
``decode(encode(msg))``; a malformed message raises ``InvalidMessage`` (a ``ValueError``) naming the
field, with the request ids it names so an instance fails that request alone; an instance's
receiver thread puts adds straight into the engine's inbox (``engine/instance.py``)."""

from __future__ import annotations

import re
import threading

import msgpack
import pytest
import zmq

from laneserve.cluster import messages as m
from laneserve.cluster.messages import (Abort, Add, Failed, Fatal, Handoff, Heartbeat, InstanceInfo, InvalidMessage,
                                        Lane, Ready, RequestDesc, SampleFirst, SampleStart, StartInfo, Stats, Stop,
                                        TokenItem, Tokens, Transfer, WireSLO, decode, encode)
from laneserve.core.sampling import SamplingParams
from laneserve.core.structured import StructuredSpec
from laneserve.core.slo import SLO
from laneserve.policies.routing import DecodeSummary

SP = SamplingParams(max_tokens=8, temperature=0.5, seed=3, stop=("x",), logit_bias=((1, 2.0),),
                    structured=StructuredSpec.regex("a+"), logprobs=2)
DESC = RequestDesc(7, [1, 2, 3], SP, 0.25, WireSLO(0.5, None), "gold", -2)
DESC3 = RequestDesc(9, [4, 5], SamplingParams(max_tokens=4, n=3), 1.0)
INFO = StartInfo(0.1, 0.2, 1, 16, [[-0.5, [[3, -0.5]]]])

MESSAGES = [
    Add(DESC), Add(DESC3, (10, 11)),
    Transfer(DESC, [4], 3, 0.3, {"kind": "shm", "path": "/x"}, INFO),
    Transfer(DESC3, [6], 2, 1.5, None, StartInfo(1.0), (SampleStart(9, 0, 6), SampleStart(11, 2, 7))),
    Abort((1, 2)), Lane("short"), Stop(),
    Ready(InstanceInfo(4096, 64, 16, 50, 123, "fcfs", "prefill", "cpu", True, "root", False), inst=1, gen=2),
    Tokens((TokenItem(7, [1, 2], None, None, INFO), TokenItem(8, [], "length", [[-1.0, []]])), inst=0),
    Handoff(7, [4], 3, {"kind": "inline"}, 0.3, None, INFO, inst=3, gen=1),
    Handoff(9, [6], 2, None, 1.5, None, StartInfo(1.0),
            (SampleFirst(9, 0, 6), SampleFirst(10, 1, 0, "stop"), SampleFirst(11, 2, 7, None, [[-2.0, []]]))),
    Stats(added=3, waiting=1, running=2, queued_tokens=40, kv_usage=0.5, kv_free=3, kv_total=8, host_free=1,
          host_total=2, preemptions=1, prefix_queries=10, prefix_hits=4, steps=9, busy=0.5, live=3, incoming=1,
          kv_held=2, kv_events=[[0, "a"], [1, "b"]], kv_forks=1, decode=DecodeSummary(2, 30, 20, ((0.05, 2),)),
          last_decode=(2, 30, 20, 0.01, 4), inst=2, gen=5),
    Stats(), Failed((7, 8), "invalid request: no"), Fatal("RuntimeError: no model"), Heartbeat(inst=4, gen=1),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=[f"{type(x).__name__}-{i}" for i, x in enumerate(MESSAGES)])
def test_every_message_kind_round_trips(msg):
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_every_registered_kind_is_covered_and_tagged():
    assert {type(x) for x in MESSAGES} == set(m._KINDS.values())
    assert len(m._KINDS) == 12
    raw = msgpack.unpackb(encode(Heartbeat(inst=4, gen=1)))
    assert raw == ["hb", 4, 1]                       # compact: a tag, then the fields, then the sender
    assert msgpack.unpackb(encode(Fatal("no", inst=2, gen=3))) == ["fatal", "no", 2, 3]


def test_numpy_figures_encode_as_numbers():
    np = pytest.importorskip("numpy")
    back = decode(encode(Stats(kv_usage=np.float64(0.5), busy=np.float32(1.0), kv_free=np.int64(3))))
    assert (back.kv_usage, back.busy, back.kv_free) == (0.5, 1.0, 3) and type(back.kv_free) is int


def test_the_request_description_builds_the_request():
    req = DESC.request()
    assert (req.request_id, req.prompt_token_ids, req.sampling, req.arrival_time) == (7, [1, 2, 3], SP, 0.25)
    assert (req.slo, req.slo_class, req.priority, req.max_output_tokens) == (SLO(0.5, None), "gold", -2, 8)
    assert RequestDesc.describe(req) == DESC
    wire = msgpack.unpackb(encode(Add(DESC)))[1]
    assert wire["slo"] == {"ttft": 0.5, "tpot": None}    # the SLO by name
    samples = MESSAGES[3].requests()
    assert [(r.request_id, r.sampling.seed, r.output_token_ids, r.num_computed_tokens) for r in samples] == [
        (9, DESC3.sampling.sample(0).seed, [6], 2), (11, DESC3.sampling.sample(2).seed, [7], 2)]
    assert all(r.times.first_token == 1.5 and r.times.prefill_start == 1.0 for r in samples)


@pytest.fixture
def slo_checks(monkeypatch):
    """Counts the runs of ``SLO``'s own checks."""
    calls = []
    check = SLO.__post_init__
    monkeypatch.setattr(SLO, "__post_init__", lambda self: (calls.append(self), check(self))[1])
    return calls


def test_a_good_slo_is_checked_once_and_the_receiver_trusts_the_codec(slo_checks):
    slo = SLO(0.5, 0.05)                                  # the API edge: checked here, once
    msg = Add(RequestDesc.describe(RequestDesc(7, [1, 2], SamplingParams(), 0.0, WireSLO.of(slo)).request()))
    back = decode(encode(msg), vocab_size=50)
    req = back.request.request()
    assert slo_checks == [slo]                            # none on the way, none at the receiver
    assert req.slo == slo and type(req.slo) is SLO and req.slo is not slo


@pytest.mark.parametrize("targets,field", [({"ttft": 0.0, "tpot": 0.1}, "ttft"), ({"ttft": None, "tpot": -1.0}, "tpot"),
                                           ({"ttft": float("nan")}, "ttft"), ({"tpot": "fast"}, "tpot")])
def test_a_bad_slo_is_refused_by_the_decoder_naming_its_field(slo_checks, targets, field):
    with pytest.raises(InvalidMessage, match=re.escape(f"'request.slo.{field}' ")) as e:
        decode(_mutated(Add(DESC), (1, "slo"), targets))
    assert e.value.rids == (7,) and slo_checks == []     # the codec refused it, not SLO's own checks


def _mutated(msg, path: tuple, value) -> bytes:
    raw = msgpack.unpackb(encode(msg))
    *head, last = path
    target = raw
    for key in head:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return msgpack.packb(raw)


_DELETE = object()


def _names(field: str) -> str:
    """An error naming ``field``, or a part of it (``'request.prompt[1]'`` names ``request.prompt``)."""
    return re.escape(f"'{field}") + r"['.\[]"

BAD = [
    # (message, where in its wire list, the value put there, the field named); a report's wire list is
    # [tag, fields..., inst, gen]
    (Add(DESC), (1, "rid"), "7", "request.rid"),
    (Add(DESC), (1, "rid"), 2 ** 64 - 1, "request.rid"),
    (Add(DESC), (1, "prompt"), [1, 2 ** 63], "request.prompt"),
    (Add(DESC), (1, "prompt"), [1, 50], "request.prompt"),           # out of the vocabulary
    (Add(DESC), (1, "sp"), _DELETE, "request.sp"),
    (Add(DESC), (1, "sp", "temperature"), "hot", "request.sp"),
    (Add(DESC), (1, "sp", "logit_bias"), [[60, 1.0]], "request.sp.logit_bias"),
    (Add(DESC), (1, "slo"), [0.5, None], "request.slo"),
    (Add(DESC), (1, "slo", "tpot"), -1.0, "request.slo.tpot"),
    (Add(DESC), (1, "cls"), None, "request.cls"),
    (Add(DESC3, (10, 11)), (2,), [10], "kids"),
    (Add(DESC3, (10, 11)), (2,), [10, "11"], "kids[1]"),
    (Add(DESC3, (10, 11)), (2,), _DELETE, "kids"),         # n = 3 needs two more ids
    (MESSAGES[2], (2,), [4, -1], "out"),
    (MESSAGES[2], (3,), 1.5, "computed"),
    (MESSAGES[2], (6, 2), -1, "info.preemptions"),
    (MESSAGES[3], (7, 1), [11, 2], "samples[1].token"),            # a field short
    (MESSAGES[3], (7, 1, 2), 99, "samples[1].token"),
    (MESSAGES[3], (7,), [], "samples"),
    (Abort((1, 2)), (1,), 5, "rids"),
    (Abort((1, 2)), (1, 0), True, "rids[0]"),
    (Lane("short"), (1,), 3, "lane"),
    (MESSAGES[7], (1, 3), -50, "info.vocab_size"),
    (MESSAGES[7], (1, 7), _DELETE, "info.device"),
    (MESSAGES[8], (1, 0, 1), [1, "2"], "items[0].tokens"),
    (MESSAGES[8], (1, 1, 2), 5, "items[1].finish"),
    (MESSAGES[9], (2,), "x", "out"),
    (MESSAGES[9], (5,), float("nan"), "t_first"),
    (MESSAGES[11], (1,), -1, "added"),
    (MESSAGES[11], (20,), [1, 2], "decode"),
    (MESSAGES[11], (21,), [1, 2, 3], "last_decode"),
    (MESSAGES[13], (1, 0), "7", "rids[0]"),
    (MESSAGES[7], (1, 11), -1, "info.tensor_parallel_size"),
    (MESSAGES[7], (1, 12), ["x"], "info.rank_pids"),
    (MESSAGES[15], (1,), "4", "inst"),
]


@pytest.mark.parametrize("msg,path,value,field", BAD, ids=[f"{type(b[0]).__name__}-{b[3]}" for b in BAD])
def test_a_malformed_message_raises_value_error_naming_the_field(msg, path, value, field):
    with pytest.raises(ValueError, match=_names(field)) as e:
        decode(_mutated(msg, path, value), vocab_size=50)
    assert isinstance(e.value, InvalidMessage) and e.value.kind == msg.tag


def test_a_malformed_request_names_its_ids_and_kv():
    e = _error(_mutated(Add(DESC), (1, "prompt"), "abc"))
    assert (e.kind, e.rids, e.kv) == ("add", (7,), None)
    e = _error(_mutated(MESSAGES[2], (3,), 99))                  # computed past prompt + out
    assert (e.rids, e.kv) == ((7,), {"kind": "shm", "path": "/x"}) and "'computed'" in str(e)
    e = _error(_mutated(MESSAGES[3], (4,), "late"))              # each sample still wanted fails
    assert e.rids == (9, 11)
    e = _error(_mutated(Add(DESC), (1, "rid"), "seven"))
    assert e.rids == ()


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb({"k": "add"}), msgpack.packb(["nope"]),
                                  msgpack.packb([]), msgpack.packb(["tok"]), msgpack.packb(["stop", 1]),
                                  msgpack.packb(["abort"]), encode(Add(DESC))[:-3]])
def test_garbage_is_an_invalid_message(data):
    e = _error(data)
    assert isinstance(e, ValueError) and e.rids == ()


def _error(data: bytes) -> InvalidMessage:
    with pytest.raises(InvalidMessage) as e:
        decode(data, vocab_size=50)
    return e.value


# ---- the engine's inbox, fed by an instance's receiver thread --------------------------------------
def test_the_inbox_gives_due_requests_in_due_order():
    from laneserve.core.clock import VirtualClock
    from laneserve.engine.instance import Inbox
    clock = VirtualClock()
    inbox = Inbox(clock)
    a, b, c = (RequestDesc(i, [1], SamplingParams(), 0.0).request() for i in range(3))
    inbox.put(b, at=2.0)
    inbox.put(a)                                     # due now (0.0)
    threading.Thread(target=inbox.put, args=(c, 1.0)).start()
    while len(inbox) < 3:
        pass
    assert inbox.next_due() == 0.0 and len(inbox.requests()) == 3
    assert inbox.drain(1.5) == [a, c] and inbox.drain(1.5) == []
    assert inbox.drain(2.0) == [b] and inbox.next_due() is None and not inbox


def test_the_engine_drains_the_inbox_it_is_given_at_operator_boundaries():
    from laneserve.core.clock import VirtualClock
    from laneserve.core.kv import KVCacheManager
    from laneserve.engine.instance import EngineInstance, Inbox
    from laneserve.policies.registry import make
    clock = VirtualClock()
    inbox = Inbox(clock)
    inst = EngineInstance(make("prefill", "fcfs", KVCacheManager(64, 16)), executor=None, clock=clock, inbox=inbox)
    put = threading.Thread(target=inbox.put, args=(RequestDesc(1, [1, 2, 3], SamplingParams(), 0.0).request(),))
    put.start()
    put.join()
    assert inst.inbox is inbox and inst.queued_tokens == 3 and inst.scheduler.num_waiting == 0
    should_stop = inst._preempt_check(None)       # what the executor asks at each operator boundary
    assert should_stop() is False                  # nothing runs: no preemption, but the arrival is in
    assert not inbox and inst.scheduler.num_waiting == 1 and inst.queued_tokens == 3


class _Sent:
    def __init__(self) -> None:
        self.messages = []

    def send(self, data) -> None:
        self.messages.append(decode(data))


def test_the_receiver_puts_adds_in_the_inbox_and_fails_a_malformed_one_alone():
    from laneserve.cluster.worker import InstanceWorker, WorkerSpec
    from laneserve.engine.instance import Inbox
    from laneserve.runtime.spec import InstanceSpec
    ctx = zmq.Context()
    spec = WorkerSpec(instance_id=2, instance=InstanceSpec.of("prefill", "fcfs"), model="m", inbox="inproc://in",
                      outbox="inproc://out", epoch=0.0, gen=1)
    w = InstanceWorker(spec, ctx)
    w.info = MESSAGES[7].info                          # vocabulary of 50
    w.inbox = Inbox(w.clock)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://in")
    push.connect("inproc://in")
    receiver = threading.Thread(target=w._receiver, args=(pull,))
    receiver.start()
    for data in (encode(Add(DESC3, (10, 11))), _mutated(Add(DESC), (1, "prompt"), [1, 99]), encode(Abort((9,))),
                 encode(Stop())):
        push.send(data)
    receiver.join(5)
    (req,) = w.inbox.drain(w.clock.now())
    assert req.request_id == 9 and w.live == {9: req} and w.sent == {9: 0} and w.kids == {9: (10, 11)}
    assert w.adds == 2                                 # both adds count as processed for the router's figures
    queued = [w.messages.get_nowait() for _ in range(w.messages.qsize())]
    assert [type(x) for x in queued] == [InvalidMessage, Abort, Stop]
    w.out = _Sent()
    w._reject(queued[0])
    (failed,) = w.out.messages
    assert isinstance(failed, Failed) and (failed.inst, failed.gen, failed.rids) == (2, 1, (7,))
    assert failed.message.startswith("invalid request: 'request.prompt'")
    for sock in (pull, push):
        sock.close(0)
    ctx.term()
