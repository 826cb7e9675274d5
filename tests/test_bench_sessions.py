"""``laneserve bench`` multi-turn sessions: conversation rules, plans, the simulator twin, the
stream parser, and a live smoke server replaying closed-loop sessions (turn order, prompts that
extend the previous prompt with the actual reply, per-turn metrics, the CLI's JSON)."""

import asyncio
import json

import httpx
import pytest

from laneserve.bench.loadgen import LoadConfig, LoadResult, RequestOutcome, stream_request
from laneserve.bench.sessions import (CHAT_ENDPOINT, ChatTurn, Conversation, SessionResult, conversation_from_messages,
                                      observed_workload, plan_sessions, run_sessions, session_summary, twin_workload)
from laneserve.cli import main
from laneserve.core import SLO, RequestSpec
from laneserve.core.prefix_cache import prefix_blocks
from laneserve.costmodel.linear import LinearCostModel
from laneserve.sim import ClusterConfig, Simulator
from server_support import TIMEOUT

INF = float("inf")


def test_conversation_rules_and_caps():
    msgs = [("system", "be brief"), ("human", "ab"), ("human", "cd"), ("gpt", "reply"), ("gpt", "stray"),
            ("system", "ignored"), ("user", "e"), ("assistant", "ok"), ("human", "unanswered")]
    conv = conversation_from_messages(msgs, count_tokens=len)
    assert conv.system == "be brief" and conv.system_tokens == 8
    assert conv.turns == [ChatTurn("ab\n\ncd", 6, 5), ChatTurn("e", 1, 2)]
    assert [t.max_tokens for t in conversation_from_messages(msgs, count_tokens=len, max_tokens=3).turns] == [3, 2]
    assert len(conversation_from_messages(msgs, count_tokens=len, max_turns=1).turns) == 1
    # context after turn 0: 8 + 6 + 5 = 19; turn 1 needs 19 + 1 + 2 = 22 tokens
    assert len(conversation_from_messages(msgs, count_tokens=len, max_context=21).turns) == 1
    assert len(conversation_from_messages(msgs, count_tokens=len, max_context=22).turns) == 2
    assert conversation_from_messages(msgs, count_tokens=len, max_context=18).turns == []


def _convs(n=3, turns=3, user=120, out=20):
    return [Conversation([ChatTurn(f"s{s} t{k} " + "x" * user, user, out) for k in range(turns)])
            for s in range(n)]


def test_plans_starts_and_think_times():
    convs = _convs(5)
    fixed = plan_sessions(convs, rate=INF, think_time=0.5, think_dist="fixed")
    assert [p.start for p in fixed] == [0.0] * 5 and all(p.think_times == [0.5, 0.5] for p in fixed)
    a, b = (plan_sessions(convs, rate=2.0, think_time=1.0, seed=s) for s in (1, 1))
    assert [(p.start, p.think_times) for p in a] == [(p.start, p.think_times) for p in b]     # deterministic
    starts = [p.start for p in a]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    thinks = [t for p in a for t in p.think_times]
    assert all(t > 0 for t in thinks) and len(set(thinks)) == len(thinks)                  # exponential draws
    assert [p.think_times for p in plan_sessions(convs, rate=2.0, think_time=1.0, seed=2)] != [p.think_times for p in a]
    with pytest.raises(ValueError, match="think-time distribution"):
        plan_sessions(convs, rate=1.0, think_time=1.0, think_dist="uniform")


def test_twin_prompts_extend_and_the_simulator_cache_reuses_them():
    plans = plan_sessions(_convs(), rate=1.0, think_time=1.0, think_dist="fixed", seed=3)
    wl = twin_workload(plans, reply_time=0.01, message_tokens=4, slo=SLO(1.0, 0.1))
    assert len(wl) == 9
    for p in plans:
        turns = sorted((s for s in wl.specs if s.session_id == p.session_id), key=lambda s: s.turn)
        assert turns[0].arrival_time == p.start and turns[0].prompt_len == 124 and turns[0].prefix_len == 0
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prefix_len == prev.prompt_len + prev.output_len
            assert cur.prompt_len == cur.prefix_len + 124
            assert cur.arrival_time == pytest.approx(prev.arrival_time + 0.01 * 20 + 1.0)
            assert prefix_blocks(cur)[:len(prefix_blocks(prev))] == prefix_blocks(prev)
    cost = LinearCostModel(prefill_per_token=2e-5, decode_fixed=0.01, decode_per_context_token=1e-7,
                           kv_capacity=400_000)
    cfg = ClusterConfig(prefill_opts={"prefix_caching": True}, prefix_cache_tokens=0)
    res = Simulator(cfg, cost).run(list(wl.specs))
    by_id = {s.request_id: s for s in wl.specs}
    prompt = {(s.session_id, s.turn): s.prompt_len for s in wl.specs}
    for r in res.requests:
        s = by_id[r.request_id]
        # one prefill instance: a later turn finds every full 64-token block of the previous prompt
        assert r.num_cached_tokens == (prompt[s.session_id, s.turn - 1] // 64 * 64 if s.turn else 0)


def _outcome(rid, session, turn, send, prompt_tokens, out_tokens, ok=True):
    spec = RequestSpec(rid, send, 10, 4, session_id=session, turn=turn)
    o = RequestOutcome(spec, success=ok, send=send, first=send + 0.1 if ok else None, end=send + 0.2,
                       output_tokens=out_tokens, prompt_tokens=prompt_tokens)
    o.chunks = [send + 0.1] if ok else []
    return o


def test_observed_workload_and_summary_from_outcomes():
    outs = [_outcome(0, 0, 0, 0.0, 100, 4), _outcome(1, 1, 0, 0.5, 80, 4), _outcome(2, 0, 1, 1.0, 130, 4),
            _outcome(3, 1, 1, 1.2, 90, 0, ok=False)]
    outs[2].cached_tokens = 96
    plans = plan_sessions(_convs(2, turns=3), rate=INF, think_time=0.0, think_dist="fixed")
    result = SessionResult(LoadResult(outs, 2.0, "m"), [[]] * 4, plans, unsent_turns=1)
    wl = observed_workload(result)
    turn1 = [s for s in wl.specs if s.turn == 1]
    assert [(s.session_id, s.arrival_time, s.prompt_len, s.prefix_len) for s in turn1] == [(0, 1.0, 130, 104),
                                                                                          (1, 1.2, 90, 84)]
    s = session_summary(result)
    assert (s["num_sessions"], s["sessions_completed"], s["turns_planned"], s["turns_sent"], s["turns_unsent"]) == \
        (2, 1, 6, 4, 1)
    assert [(r["turn"], r["num_requests"], r["completed"]) for r in s["per_turn"]] == [(0, 2, 2), (1, 2, 1)]
    assert s["total_prompt_tokens"] == 310 and s["total_cached_tokens"] == 96
    assert s["later_turns"]["cache_hit_rate"] == pytest.approx(96 / 130)
    assert s["first_turn"]["mean_ttft_ms"] == pytest.approx(100.0)


def test_stream_parser_reads_chat_deltas_and_cached_tokens():
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 32}}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=body)

    async def go(out):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_request(client, LoadConfig(laneserve_extensions=False), "http://x/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}]}, 0.0, out)

    out = RequestOutcome(RequestSpec(0, 0.0, 5, 2))
    asyncio.run(go(out))
    assert out.success and out.text == "Hello" and len(out.chunks) == 2
    assert (out.prompt_tokens, out.output_tokens, out.cached_tokens) == (50, 2, 32)
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert "return_token_ids" not in seen


# ---- live: a 1P+1D smoke server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(shared_server):
    srv = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")    # tests/conftest.py
    srv.wait_ready()
    return srv


def _prompt_ids(server, model, messages):
    body = {"model": model, "messages": messages, "max_tokens": 1, "return_token_ids": True}
    r = httpx.post(server.url + CHAT_ENDPOINT, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"]


def test_live_sessions_are_closed_loop_and_prompts_extend(server):
    convs = [Conversation([ChatTurn(f"session {s} question {k}: serve the model", 8, 3) for k in range(3)],
                          system="You are terse." if s == 0 else None, system_tokens=4 if s == 0 else 0)
             for s in range(3)]
    plans = plan_sessions(convs, rate=INF, think_time=0.05, think_dist="fixed")
    cfg = LoadConfig(base_url=server.url, endpoint=CHAT_ENDPOINT, progress=False, timeout=TIMEOUT)
    result = asyncio.run(run_sessions(cfg, plans, slo=SLO(5.0, 1.0)))
    outs = result.load.outcomes
    assert len(outs) == 9 and all(o.success for o in outs), [o.error for o in outs]
    for sid in range(3):
        idx = sorted((i for i, o in enumerate(outs) if o.spec.session_id == sid), key=lambda i: outs[i].spec.turn)
        assert [outs[i].spec.turn for i in idx] == [0, 1, 2]
        ids = []
        for k, i in enumerate(idx):
            o, msgs = outs[i], result.messages[i]
            assert o.output_tokens == 3 and o.text
            assert msgs[-1] == {"role": "user", "content": convs[sid].turns[k].user}
            ids.append(_prompt_ids(server, result.load.model, msgs))
            assert o.prompt_tokens == len(ids[-1])
            if k:
                prev, prev_msgs = outs[idx[k - 1]], result.messages[idx[k - 1]]
                assert o.send >= prev.end + 0.05                        # after the reply plus the think time
                assert msgs[:-1] == [*prev_msgs, {"role": "assistant", "content": prev.text}]
                # the token ids extend the previous prompt's, but for its last token: the template's
                # generation prompt ends in a space that the BPE merges with the reply's first byte
                assert len(ids[k]) > len(ids[k - 1]) and ids[k][:len(ids[k - 1]) - 1] == ids[k - 1][:-1]
        assert (result.messages[idx[0]][0]["role"] == "system") == (sid == 0)
    s = session_summary(result)
    assert [(r["turn"], r["completed"]) for r in s["per_turn"]] == [(0, 3), (1, 3), (2, 3)]
    for row in (*s["per_turn"], s["first_turn"], s["later_turns"]):
        assert all(row[k] is not None and row[k] > 0 for k in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms",
                                                                "p99_ttft_ms", "mean_prompt_tokens"))
    assert s["later_turns"]["mean_prompt_tokens"] > s["first_turn"]["mean_prompt_tokens"]
    assert s["total_cached_tokens"] == sum(o.cached_tokens for o in outs) <= s["total_prompt_tokens"]
    assert s["turns_unsent"] == 0 and s["sessions_completed"] == 3


def test_bench_cli_sessions_writes_json(server, tmp_path, capsys):
    data = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"hello {i}"}, {"from": "gpt", "value": "hi"},
                                             {"from": "human", "value": "and again"}, {"from": "gpt", "value": "yes"}]}
            for i in range(2)]
    src = tmp_path / "convs.json"
    src.write_text(json.dumps(data))
    out = tmp_path / "r.json"
    rc = main(["bench", "--base-url", server.url, "--sessions", str(src), "--num-sessions", "2", "--max-turns", "2",
               "--think-time", "0", "--session-max-tokens", "2", "--request-rate", "inf", "--no-progress",
               "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Multi-turn Sessions" in printed and "TTFT, later turns" in printed
    res = json.loads(out.read_text())
    assert res["endpoint"] == CHAT_ENDPOINT and res["completed"] == 4 and res["turns_sent"] == 4
    assert [r["turn"] for r in res["per_turn"]] == [0, 1] and res["prefix_cache_hit_rate"] is not None
    assert sorted(zip(res["session_ids"], res["turns"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert main(["bench", "--base-url", server.url, "--sessions", str(src), "--think-time-dist", "normal"]) == 2
