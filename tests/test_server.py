"""End-to-end tests of ``laneserve serve`` on 127.0.0.1: the official ``openai`` client
against a live 1P+1D deployment of the smoke model, token identity with a colocated single-process
server, every kind of bad input, client disconnects (KV back to free on both instances),
admission control, and crashed instances (real engine and stub instances).

Three servers start in parallel: for the module, 1P+1D (engine processes) and a 1P+2D deployment of
STUB instances (no torch; tokens paced at 20 ms) for the crash tests; and colocated (one instance),
the session's (tests/conftest.py: no test here changes it). Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from server_support import TIMEOUT, Server
from server_support import wait_all_free as _wait_all_free
from server_support import wait_for

openai = pytest.importorskip("openai")

MAX_INFLIGHT = 6


@pytest.fixture(scope="module")
def servers(shared_server):
    pd = Server("--prefill", "1", "--decode", "1", "--max-inflight", str(MAX_INFLIGHT), "--kv-tokens", "16384",
                "--slo-class", "interactive:ttft_ms=200,tpot_ms=40,priority=-1")
    colo = shared_server("--colocated", "--kv-tokens", "16384")     # the session's (tests/conftest.py)
    stub = Server("--stub", "--prefill", "1", "--decode", "2", "--stub-token-delay", "0.02", "--max-restarts", "0")
    try:
        for s in (stub, pd, colo):
            s.wait_ready()
        yield {"pd": pd, "colo": colo, "stub": stub}
    finally:
        for s in (pd, stub):
            s.interrupt()
        for s in (pd, stub):
            s.stop()


MODEL = "smoke-llama"


# ---- the openai client ------------------------------------------------------------------------
def test_completion_chat_and_models(servers):
    client = servers["pd"].client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="hello the world", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    # the smoke model's byte-level BPE spells "hello the world" in 8 tokens
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 8
    assert out.choices[0].text.strip()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6


def test_streaming_with_usage_matches_non_streaming(servers):
    client = servers["pd"].client()
    kwargs = dict(model=MODEL, prompt="the model serve token", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].choices == []
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == "length"
    # raw SSE ends with [DONE]
    with httpx.stream("POST", servers["pd"].url + "/v1/chat/completions", timeout=TIMEOUT,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_pd_greedy_tokens_identical_to_colocated(servers):
    prompts = [[5, 17, 300, 42, 8, 99], list(range(20, 120)), "hello the world", "serve prefill decode " * 30]
    got = {}
    for name in ("pd", "colo"):
        client = servers[name].client()
        got[name] = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
                     .model_dump()["choices"][0]["token_ids"] for p in prompts]
    assert all(len(t) == 24 for t in got["pd"])
    assert got["pd"] == got["colo"]


def test_metrics_endpoint(servers):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(servers["pd"].url + "/metrics", timeout=5).text
    samples = {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text)
               for s in f.samples}
    names = {name for name, _ in samples}
    for name in ("laneserve:time_to_first_token_seconds_count", "laneserve:inter_token_latency_seconds_bucket",
                 "laneserve:e2e_request_latency_seconds_sum", "laneserve:request_queue_time_seconds_count",
                 "laneserve:num_requests_waiting", "laneserve:kv_cache_usage_perc", "laneserve:num_preemptions_total"):
        assert name in names, name
    assert ("laneserve:num_requests_running", (("engine", "1"), ("model_name", "smoke-llama"),
                                               ("role", "decode"))) in samples


def test_second_chat_turn_reports_cached_prompt_tokens(servers):
    """Prefix caching (on by default): turn 2 of a chat finds the system prompt and turn 1 cached on
    the prefill instance, says so in usage.prompt_tokens_details.cached_tokens, and /metrics counts it."""
    from prometheus_client.parser import text_string_to_metric_families
    system = "You answer questions about serving systems, briefly and precisely. " * 8
    for name in ("pd", "colo"):
        client = servers[name].client()
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"what is {name}?"}]
        one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        msgs += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert one.usage.prompt_tokens * 0.8 < cached < two.usage.prompt_tokens
        assert cached % 16 == 0                          # whole KV blocks

        def counters(name=name, cached=cached):    # stats reach the router a moment after the response
            text = httpx.get(servers[name].url + "/metrics", timeout=5).text
            got = {"laneserve:prefix_cache_hits_total": 0.0, "laneserve:prefix_cache_queries_total": 0.0}
            for s in (s for f in text_string_to_metric_families(text) for s in f.samples if s.name in got):
                got[s.name] += s.value
            return got if got["laneserve:prefix_cache_hits_total"] >= cached else None

        got = wait_for(counters, 10, "the prefix-cache counters")
        assert got["laneserve:prefix_cache_hits_total"] < got["laneserve:prefix_cache_queries_total"]


# ---- bad input ----------------------------------------------------------------------------------
BAD = [
    ("malformed JSON", b'{"model": "smoke-llama", "prompt": ', "malformed JSON"),
    ("missing prompt", {"model": MODEL}, "missing required field 'prompt'"),
    ("allowed token outside vocab", {"model": MODEL, "prompt": "hi", "allowed_token_ids": [99999]},
     "outside the vocabulary"),
    ("unknown field in slo", {"model": MODEL, "prompt": "hi", "slo": {"ttft": 5}}, "unknown field 'slo.ttft'"),
    ("prompt too long", {"model": MODEL, "prompt": [7] * 4100}, "maximum context length"),
    ("prompt + max_tokens too long", {"model": MODEL, "prompt": [7] * 4000, "max_tokens": 200}, "maximum context length"),
    ("negative temperature", {"model": MODEL, "prompt": "hi", "temperature": -1}, "'temperature' must be in"),
    ("top_p zero", {"model": MODEL, "prompt": "hi", "top_p": 0}, "'top_p' must be in"),
    ("max_tokens zero", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "'max_tokens' must be >= 1"),
    ("max_tokens string", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, "'max_tokens' must be an integer"),
    ("suffix", {"model": MODEL, "prompt": "hi", "suffix": "x"}, "'suffix' is not supported"),
    ("token id outside vocab", {"model": MODEL, "prompt": [1, 99999]}, "outside the vocabulary"),
    ("stream_options without stream", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
     "only allowed when 'stream' is true"),
    ("bad slo", {"model": MODEL, "prompt": "hi", "slo": {"ttft_ms": -5}}, "'slo.ttft_ms' must be a number > 0"),
    ("unknown slo class", {"model": MODEL, "prompt": "hi", "slo_class": "gold"}, "unknown slo_class 'gold'"),
]


@pytest.mark.parametrize("name,body,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_400(servers, name, body, message):
    url = servers["pd"].url + "/v1/completions"
    r = (httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
         if isinstance(body, bytes) else httpx.post(url, json=body, timeout=TIMEOUT))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_bad_chat_header_and_model(servers):
    url = servers["pd"].url
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"x-slo-ttft-ms": "soon"}, timeout=TIMEOUT)
    assert r.status_code == 400 and "x-slo-ttft-ms" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, timeout=TIMEOUT)
    assert r.status_code == 404
    with pytest.raises(openai.BadRequestError, match="temperature"):
        servers["pd"].client().completions.create(model=MODEL, prompt="hi", temperature=5)
    # SLO headers, fields and a launch-time class are accepted
    r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, headers={"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "80"},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "slo_class": "interactive", "priority": 1})
    assert r.status_code == 200, r.text


# ---- disconnects and overload ----------------------------------------------------------------------
def _long_stream(url: str, max_tokens: int = 3000):
    body = {"model": MODEL, "prompt": list(range(30, 230)), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    return httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT)


def test_streaming_disconnect_frees_kv_on_both_instances(servers):
    pd = servers["pd"]
    _wait_all_free(pd)
    with _long_stream(pd.url) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(ln.startswith("data: ") for ln in got)
        deadline = time.monotonic() + 10
        while True:                         # the decode instance holds the request's KV now
            dec = [i for i in pd.state()["instances"] if i["role"] == "decode"][0]
            if dec["kv_free_blocks"] < dec["kv_total_blocks"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert dec["kv_free_blocks"] < dec["kv_total_blocks"]
    # leaving the block closed the connection mid-stream
    st = _wait_all_free(pd)
    assert all(i["alive"] for i in st["instances"])


def test_non_streaming_disconnect_cancels(servers):
    pd = servers["pd"]
    body = {"model": MODEL, "prompt": list(range(30, 430)), "max_tokens": 3600, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(pd.url + "/v1/completions", json=body, timeout=0.5)
    _wait_all_free(pd)


def test_overload_gets_429_with_retry_after(servers):
    pd = servers["pd"]
    _wait_all_free(pd)
    streams = [_long_stream(pd.url) for _ in range(MAX_INFLIGHT)]
    readers = []                            # keep the line iterators: closing one disconnects
    try:
        for s in streams:
            readers.append(s.__enter__().iter_lines())
            next(readers[-1])
        r = httpx.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=TIMEOUT)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert "overloaded" in r.json()["error"]["message"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    _wait_all_free(pd)
    ok = httpx.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
    assert ok.status_code == 200


# ---- crashed instances -------------------------------------------------------------------------------
def _stream_tokens(url: str, max_tokens: int):
    """Open a stream and return (response context, line iterator) after its first token."""
    body = {"model": "laneserve-stub", "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}
    ctx = httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT)
    r = ctx.__enter__()
    lines = r.iter_lines()
    next(lines)
    return ctx, lines


def test_stub_decode_crash_fails_cleanly_and_routes_around(servers):
    stub = servers["stub"]
    streams = [_stream_tokens(stub.url, 150) for _ in range(4)]       # 3 s each at 20 ms per token
    try:
        def all_streams_decoding():
            decoders = [i for i in stub.state()["instances"] if i["role"] == "decode"]
            return decoders if sum(i["live_requests"] or 0 for i in decoders) == len(streams) else None

        decoders = wait_for(all_streams_decoding, TIMEOUT, "every stream to reach a decode instance")
        victim = max(decoders, key=lambda i: i["live_requests"] or 0)
        assert victim["live_requests"] >= 1
        os.kill(victim["pid"], signal.SIGKILL)
        ended_with_error = 0
        for ctx, lines in streams:
            rest = [ln for ln in lines if ln]    # every stream ends (timeout-bounded): none hangs
            if any("crashed" in ln for ln in rest):
                ended_with_error += 1
                assert rest[-1] == "data: [DONE]"
        assert ended_with_error == victim["live_requests"]
    finally:
        for ctx, _ in streams:
            ctx.__exit__(None, None, None)
    st = stub.state()
    assert [i["alive"] for i in st["instances"]].count(False) == 1
    health = httpx.get(stub.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    from prometheus_client.parser import text_string_to_metric_families
    metrics = {(s.name, s.labels["engine"]): s.value
               for f in text_string_to_metric_families(httpx.get(stub.url + "/metrics", timeout=5).text)
               for s in f.samples if "engine" in s.labels}
    vid = str(victim["id"])
    assert metrics[("laneserve:instance_up", vid)] == 0
    assert ("laneserve:kv_cache_usage_perc", vid) not in metrics
    client = stub.client()
    for _ in range(3):                          # routed to the surviving decode instance
        out = client.completions.create(model="laneserve-stub", prompt=[4, 5, 6], max_tokens=5)
        assert out.usage.completion_tokens == 5
    assert httpx.get(stub.url + "/health", timeout=5).status_code == 200
    survivor = [i for i in st["instances"] if i["role"] == "decode" and i["alive"]][0]
    os.kill(survivor["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(stub.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(stub.url + "/v1/completions", json={"model": "laneserve-stub", "prompt": [1], "max_tokens": 2},
                   timeout=TIMEOUT)
    assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"]


def test_engine_decode_crash_fails_cleanly_and_restarts(servers):
    """Kill the 1P+1D server's decode process mid-request: the request ends with an error event,
    the instance is restarted (a new process) and serves again."""
    pd = servers["pd"]
    _wait_all_free(pd)
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 3000, "ignore_eos": True}
    with httpx.stream("POST", pd.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        next(lines)
        dec = [i for i in pd.state()["instances"] if i["role"] == "decode"][0]
        os.kill(dec["pid"], signal.SIGKILL)
        rest = [ln for ln in lines if ln]
    assert any("crashed" in ln for ln in rest) and rest[-1] == "data: [DONE]"
    deadline = time.monotonic() + 120
    while True:                                # bounded: the restart must happen
        new = [i for i in pd.state()["instances"] if i["role"] == "decode"][0]
        if new["status"] == "ready":
            break
        assert time.monotonic() < deadline, new
        time.sleep(0.2)
    assert new["restarts"] == 1 and new["pid"] != dec["pid"]
    out = pd.client().completions.create(model=MODEL, prompt="hello again", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert httpx.get(pd.url + "/health", timeout=5).json()["status"] == "ok"
    _wait_all_free(pd)
