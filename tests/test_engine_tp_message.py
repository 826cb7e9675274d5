"""The step message rank 0 broadcasts is a diff: a request's tokens go once (then one new token
per decode), a block table only when it changed (only the new blocks when it grew), departed
requests by id; the follower's mirror rebuilds exactly rank 0's sequences from it. Also the
shared-memory channel between processes' worth of readers (threads here)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan
from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.engine.runner import plan_sequences, prompt_logprob_rows
from laneserve.engine.tp.channel import ChannelReader, StepChannel
from laneserve.engine.tp.step_message import StepEncoder, StepMirror


def _req(rid: int, n: int) -> Request:
    return Request(request_id=rid, arrival_time=0.0, prompt_len=n, max_output_tokens=50, slo=SLO(),
                   prompt_token_ids=[rid * 100 + i for i in range(n)])


def _send(enc, mirror, plan, kv):
    seqs = plan_sequences(plan, kv)
    msg = enc.encode(plan, seqs, prompt_logprob_rows(seqs), kv, False)
    msg = pickle.loads(pickle.dumps(msg))
    got, _rows = mirror.apply(msg)
    assert [(s.request.request_id, s.token_ids, s.start, s.sample, s.is_decode) for s in got] == \
        [(s.request.request_id, s.token_ids, s.start, s.sample, s.is_decode) for s in seqs]
    for s in seqs:
        assert mirror.table(s.request.request_id) == kv.table(s.request.request_id)
    return msg


def test_decode_steps_send_ids_and_one_new_token_each():
    kv = KVCacheManager(64, 4)
    enc, mirror = StepEncoder(), StepMirror(64, 4)
    a, b = _req(1, 10), _req(2, 8)
    kv.allocate(1, 6)
    msg = _send(enc, mirror, StepPlan(prefills=[PrefillChunk(a, 0, 6)]), kv)       # a's first chunk
    assert list(msg.tokens[1]) == a.prompt_token_ids[:6] and list(msg.tables[1][1]) == kv.table(1)
    a.num_computed_tokens = 6
    kv.allocate(1, 10)
    kv.allocate(2, 8)
    msg = _send(enc, mirror, StepPlan(prefills=[PrefillChunk(a, 6, 4), PrefillChunk(b, 0, 8)]), kv)
    assert list(msg.tokens[1]) == a.prompt_token_ids[6:]              # only what a's mirror lacks
    keep, blocks = msg.tables[1]
    assert keep == 2 and list(blocks) == kv.table(1)[2:]             # only the appended blocks
    for r, tok in ((a, 7), (b, 8)):
        r.num_computed_tokens = r.prompt_len
        r.record_token(0.0, tok)
    kv.allocate(1, 11)
    kv.allocate(2, 9)
    msg = _send(enc, mirror, StepPlan(decodes=[a, b]), kv)
    assert {rid: list(t) for rid, t in msg.tokens.items()} == {1: [7], 2: [8]}
    assert 1 not in msg.tables and list(msg.tables[2][1]) == kv.table(2)[2:]    # b crossed a block
    for r, tok in ((a, 9), (b, 10)):
        r.num_computed_tokens += 1
        r.record_token(1.0, tok)
    kv.allocate(1, 12)
    kv.allocate(2, 10)
    kv.free(1)
    msg = _send(enc, mirror, StepPlan(decodes=[b]), kv)
    assert msg.gone == [1] and 1 not in mirror.tokens and not msg.tables
    assert {rid: list(t) for rid, t in msg.tokens.items()} == {2: [10]}


def test_channel_delivers_each_message_to_every_reader_once():
    chan = StepChannel.create(mp.get_context("spawn"), 3, capacity=1 << 16)
    got: list[list] = [[], [], []]

    def read(i: int) -> None:
        reader = ChannelReader(chan.handle(i))
        while (m := reader.receive(lambda: True, poll_s=0.1)) != "end":
            got[i].append(m)
        reader.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for m in range(50):                      # the writer waits for every reader before overwriting
        chan.publish({"n": m, "pad": "x" * (m * 97 % 900)})
    chan.publish("end")
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    chan.close()
    assert all([m["n"] for m in g] == list(range(50)) for g in got)


def test_files_of_a_dead_group_are_swept_and_live_ones_kept(tmp_path, monkeypatch):
    import os
    import subprocess

    from laneserve.engine.tp import channel

    monkeypatch.setattr(channel, "shm_folder", lambda: tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [tmp_path / f"laneserve-tp-{dead.pid}-abc", tmp_path / f"laneserve-stop-{dead.pid}-abc"]
    live = [tmp_path / f"laneserve-tp-{os.getpid()}-abc", tmp_path / "other-file"]
    for f in stale + live:
        f.write_bytes(b"x")
    assert sorted(channel.sweep_stale()) == sorted(f.name for f in stale)
    assert [f.exists() for f in stale + live] == [False, False, True, True]
