"""A server that one request cannot take down, end to end on 127.0.0.1.

Two servers start once for the module: a 1P+1D engine deployment of the smoke model (hostile
bodies, a property-based fuzz run, a crash and restart under load) and a 1P+1D STUB deployment
with a 2 s heartbeat deadline and an API key (hung instances, authentication). The graceful
shutdown test starts a stub server of its own, since it ends it. Every wait is bounded and fails
when what it waits for does not happen."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import TIMEOUT, Server, wait_all_free, wait_for

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
STUB = "laneserve-stub"
MAX_INFLIGHT = 8
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def servers():
    eng = Server("--prefill", "1", "--decode", "1", "--max-inflight", str(MAX_INFLIGHT), "--kv-tokens", "16384",
                 "--max-request-bytes", str(1 << 20))
    stub = Server("--stub", "--prefill", "1", "--decode", "1", "--stub-token-delay", "0.02",
                  "--heartbeat-timeout", "2", env={"LANESERVE_API_KEY": KEY}, api_key=KEY)
    try:
        for s in (stub, eng):
            s.wait_ready()
        yield {"eng": eng, "stub": stub}
    finally:
        for s in (eng, stub):
            s.interrupt()
        for s in (eng, stub):
            s.stop()


def _post(server: Server, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, timeout=TIMEOUT, headers={
            "content-type": "application/json", **server.headers, **kw.pop("headers", {})}, **kw)
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT, headers={**server.headers,
                                                                              **kw.pop("headers", {})}, **kw)


def _assert_at_rest_and_unhurt(server: Server) -> None:
    st = wait_all_free(server)
    assert all(i["status"] == "ready" and i["restarts"] == 0 for i in st["instances"]), st["instances"]
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def _nested(depth: int) -> bytes:
    return b'{"model": "smoke-llama", "prompt": "hi", "user": ' + b"[" * depth + b"]" * depth + b"}"


# (name, raw body or dict, the statuses that are right: 400 for what is refused, 200 for what is
# normalised, such as a temperature below 1e-5, which is greedy)
HOSTILE = [
    ("temperature NaN", b'{"model": "smoke-llama", "prompt": "hi", "temperature": NaN}', {400}),
    ("temperature Infinity", b'{"model": "smoke-llama", "prompt": "hi", "temperature": Infinity}', {400}),
    ("temperature 1e999", b'{"model": "smoke-llama", "prompt": "hi", "temperature": 1e999}', {400}),
    ("temperature 1e-40 is greedy", {"model": MODEL, "prompt": "hi", "temperature": 1e-40, "max_tokens": 3}, {200}),
    ("top_p NaN", b'{"model": "smoke-llama", "prompt": "hi", "top_p": NaN}', {400}),
    ("seed 1.9e13", {"model": MODEL, "prompt": "hi", "seed": 19_000_000_000_000, "max_tokens": 3}, {200}),
    ("seed 2**63 - 1", {"model": MODEL, "prompt": "hi", "seed": 2**63 - 1, "max_tokens": 3}, {200}),
    ("seed 2**64", {"model": MODEL, "prompt": "hi", "seed": 2**64}, {400}),
    ("seed -2**70", {"model": MODEL, "prompt": "hi", "seed": -(2**70)}, {400}),
    ("top_k 2**64", {"model": MODEL, "prompt": "hi", "top_k": 2**64}, {400}),
    ("priority 2**64", {"model": MODEL, "prompt": "hi", "priority": 2**64}, {400}),
    ("stop_token_ids 2**64", {"model": MODEL, "prompt": "hi", "stop_token_ids": [2**64]}, {400}),
    ("max_tokens 2**64", {"model": MODEL, "prompt": "hi", "max_tokens": 2**64}, {400}),
    ("prompt token 2**64", {"model": MODEL, "prompt": [1, 2**64]}, {400}),
    ("lone surrogate in prompt", b'{"model": "smoke-llama", "prompt": "hi \\ud800 there"}', {400}),
    ("lone surrogate in a chat message", b'{"model": "smoke-llama", "messages": [{"role": "user", '
                                         b'"content": "\\udfff"}]}', {400}),
    ("invalid UTF-8", b'{"model": "smoke-llama", "prompt": "\xff\xfe"}', {400}),
    ("5,000-deep nesting", _nested(5000), {400}),
    ("100k-digit number", b'{"model": "smoke-llama", "prompt": "hi", "max_tokens": ' + b"9" * 100_000 + b"}", {400}),
    ("body of a JSON string", b'"just a string"', {400}),
    ("empty body", b"", {400}),
    ("SLO of NaN ms", b'{"model": "smoke-llama", "prompt": "hi", "slo": {"ttft_ms": NaN}}', {400}),
]


@pytest.mark.parametrize("name,body,ok", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_is_refused_without_harm(servers, name, body, ok):
    eng = servers["eng"]
    path = "/v1/chat/completions" if b'"messages"' in (body if isinstance(body, bytes) else b"") else "/v1/completions"
    r = _post(eng, body, path)
    assert r.status_code in ok, (r.status_code, r.text[:300])
    assert "error" in r.json() if r.status_code >= 400 else r.json()["choices"]
    st = wait_all_free(eng)
    assert all(i["status"] == "ready" and i["restarts"] == 0 for i in st["instances"])


def test_hostile_headers_are_refused(servers):
    eng = servers["eng"]
    for value in ("nan", "inf", "-1", "1e999", "0"):
        r = _post(eng, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers={"x-slo-ttft-ms": value})
        assert r.status_code == 400, (value, r.text)
    _assert_at_rest_and_unhurt(eng)


def test_oversized_bodies_get_413_before_parsing(servers):
    eng = servers["eng"]                       # --max-request-bytes 1 MiB
    big = b'{"model": "smoke-llama", "prompt": "' + b"a" * (2 << 20) + b'"}'
    r = _post(eng, big)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():                              # no Content-Length: counted as it arrives
        yield b'{"model": "smoke-llama", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'
    r = httpx.post(eng.url + "/v1/completions", content=chunks(), timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    # a prompt under the byte limit but far over the context is a 400
    r = _post(eng, {"model": MODEL, "prompt": "hello world " * 60_000})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    _assert_at_rest_and_unhurt(eng)


def test_unpackable_ints_do_not_leak_admission_slots(servers):
    """Eight requests with a seed of 2**64 on a --max-inflight 8 server (the openai client retries
    each twice by default): afterwards nothing is in flight and a valid request is served."""
    eng = servers["eng"]
    client = openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=2, timeout=TIMEOUT)
    for _ in range(MAX_INFLIGHT):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=2**64)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    _assert_at_rest_and_unhurt(eng)


# ---- property-based fuzzing of request bodies and headers against the live server -------------
_WEIRD = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.lists(st.integers(min_value=-5, max_value=2**65), max_size=4),
                   st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
_SMALL_NUM = st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), st.integers(-2, 3))
_FIELDS = {
    "temperature": st.one_of(_SMALL_NUM, st.sampled_from([1e-40, 1e-6, float("nan"), float("inf")]), _WEIRD),
    "top_p": st.one_of(_SMALL_NUM, _WEIRD),
    "top_k": st.one_of(st.integers(-3, 2000), st.sampled_from([2**31, 2**63, 2**64]), _WEIRD),
    "max_tokens": st.one_of(st.integers(-1, 6), st.sampled_from([10**6, 2**64]), _WEIRD),
    "seed": st.one_of(st.integers(-(2**64), 2**64), _WEIRD),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5), _WEIRD),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 2**64), max_size=5), _WEIRD),
    "priority": st.one_of(st.integers(-(2**64), 2**64), _WEIRD),
    "logprobs": st.one_of(st.integers(-1, 25), _WEIRD),
    "ignore_eos": st.one_of(st.booleans(), _WEIRD),
    "stream": st.one_of(st.booleans(), _WEIRD),
    "n": st.one_of(st.integers(0, 3), _WEIRD),
    "user": st.one_of(st.text(max_size=20), _WEIRD),
    "slo": st.one_of(st.fixed_dictionaries({}, optional={"ttft_ms": _WEIRD | _SMALL_NUM,
                                                         "tpot_ms": _WEIRD | _SMALL_NUM}), _WEIRD),
    "slo_class": _WEIRD,
}
_PROMPT = st.one_of(st.text(min_size=0, max_size=40), st.lists(st.integers(-3, 2**64), max_size=8),
                    st.lists(st.text(max_size=5), max_size=3), _WEIRD)
_MESSAGES = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", ""]),
                                                      "content": st.one_of(st.text(max_size=30), _WEIRD)}),
                               max_size=3), _WEIRD)
_HEADER_VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=8)


@st.composite
def _requests(draw):
    chat = draw(st.booleans())
    body = {"model": draw(st.sampled_from([MODEL, MODEL, "", "gpt-x"]))}
    body["messages" if chat else "prompt"] = draw(_MESSAGES if chat else _PROMPT)
    for name in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=5, unique=True)):
        body[name] = draw(_FIELDS[name])
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 4))      # most requests are served quickly
    headers = {}
    for h in draw(st.lists(st.sampled_from(["x-slo-ttft-ms", "x-slo-tpot-ms"]), max_size=2, unique=True)):
        headers[h] = draw(_HEADER_VALUE)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, headers


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(req=_requests())
def test_fuzzed_requests_never_get_5xx(servers, req):
    path, body, headers = req
    eng = servers["eng"]
    raw = json.dumps(body, allow_nan=True).encode()      # NaN/Infinity as JS literals, as clients send them
    with httpx.stream("POST", eng.url + path, content=raw, timeout=TIMEOUT,
                      headers={"content-type": "application/json", **headers}) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (body, headers, r.status_code, text[:300])
    if r.status_code == 200 and body.get("stream") is True:
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]


def test_after_fuzzing_the_server_is_at_rest_and_unhurt(servers):
    _assert_at_rest_and_unhurt(servers["eng"])


# ---- authentication ------------------------------------------------------------------------------
def test_api_key(servers):
    stub = servers["stub"]
    for path in ("/v1/models", "/debug/state"):
        r = httpx.get(stub.url + path, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(stub.url + path, timeout=5, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(stub.url + path, timeout=5, headers=stub.headers).status_code == 200
    r = httpx.post(stub.url + "/v1/completions", json={"model": STUB, "prompt": [1, 2], "max_tokens": 2}, timeout=5)
    assert r.status_code == 401
    for path in ("/health", "/metrics"):                  # open unless --api-key-all-paths
        assert httpx.get(stub.url + path, timeout=5).status_code == 200
    out = stub.client().completions.create(model=STUB, prompt=[1, 2, 3], max_tokens=3)
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stub.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_api_key_flag_beats_the_environment(monkeypatch):
    from laneserve.cli import build_parser
    from laneserve.commands.serve import build_server
    monkeypatch.setenv("LANESERVE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--stub", "--api-key", "from-flag", "--api-key-all-paths"])
    app, _ = build_server(args, log=lambda s: None)
    assert app.state.api_key == "from-flag" and app.state.protect_all
    args = build_parser().parse_args(["serve", "--stub"])
    assert build_server(args, log=lambda s: None)[0].state.api_key == "from-env"


# ---- supervision ---------------------------------------------------------------------------------
def _open_stream(server: Server, max_tokens: int):
    body = {"model": STUB, "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}
    ctx = httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT, headers=server.headers)
    lines = ctx.__enter__().iter_lines()
    next(lines)
    return ctx, lines


def test_hung_instance_is_detected_killed_and_restarted(servers):
    """SIGSTOP the decode instance holding a stream: within the 2 s heartbeat deadline the router
    declares it hung, the stream ends with an error event (not a hang: the client's timeout would
    fail the test), the process is killed and a new one serves."""
    stub = servers["stub"]
    ctx, lines = _open_stream(stub, 400)                   # 8 s at 20 ms per token
    try:
        dec = wait_for(lambda: next((i for i in stub.state()["instances"]
                                     if i["role"] == "decode" and i["live_requests"]), None), 10, "the stream on decode")
        os.kill(dec["pid"], signal.SIGSTOP)
        rest = [ln for ln in lines if ln]
    finally:
        ctx.__exit__(None, None, None)
    errors = [json.loads(ln[6:]) for ln in rest if ln.startswith("data: {") and '"error"' in ln]
    assert errors and "heartbeat" in errors[0]["error"]["message"], rest[-3:]
    assert rest[-1] == "data: [DONE]"
    new = wait_for(lambda: next((i for i in stub.state()["instances"]
                                 if i["role"] == "decode" and i["status"] == "ready" and i["restarts"] == 1), None),
                   30, "the hung instance to be restarted")
    assert new["pid"] != dec["pid"]
    out = stub.client().completions.create(model=STUB, prompt=[4, 5, 6], max_tokens=4)
    assert out.usage.completion_tokens == 4
    assert stub.state()["in_flight"] == 0


def test_sigterm_drains_a_running_stream():
    """SIGTERM while a stream runs: the stream completes (every token and [DONE]), new connections
    are refused, the server exits 0 without alarming 'is down' lines."""
    srv = Server("--stub", "--prefill", "1", "--decode", "1", "--stub-token-delay", "0.02", "--shutdown-timeout", "20")
    try:
        srv.wait_ready()
        done = threading.Event()
        got: dict = {}

        def read():
            body = {"model": STUB, "prompt": [7, 8, 9], "max_tokens": 100, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                got["lines"] = [ln for ln in r.iter_lines() if ln]
            done.set()
        t = threading.Thread(target=read, daemon=True)
        t.start()
        wait_for(lambda: srv.state()["in_flight"] == 1, 10, "the stream to start")
        srv.proc.send_signal(signal.SIGTERM)
        assert done.wait(TIMEOUT), "the stream did not finish"
        lines = got["lines"]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 100
        assert not any('"error"' in ln for ln in lines)
        assert srv.proc.wait(timeout=30) == 0
        stderr = srv.proc.stderr.read()
        assert "is down" not in stderr and "shutting down" in stderr
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()


def test_engine_crash_under_load_loses_nothing(servers):
    """Kill the engine's prefill instance while several requests run: every request gets an answer
    (tokens or an error), the instance comes back, and nothing is left in flight."""
    eng = servers["eng"]
    wait_all_free(eng)
    results: list = []

    def one(i: int) -> None:
        try:
            r = _post(eng, {"model": MODEL, "prompt": list(range(10 + i, 400 + i)), "max_tokens": 40,
                            "ignore_eos": True})
            results.append(r.status_code)
        except httpx.HTTPError as exc:                      # a lost request: the test fails below
            results.append(repr(exc))
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    pre = wait_for(lambda: next((i for i in eng.state()["instances"] if i["role"] == "prefill"), None), 5, "state")
    time.sleep(0.2)
    os.kill(pre["pid"], signal.SIGKILL)
    for t in threads:
        t.join(TIMEOUT + 5)
    assert len(results) == 6 and all(isinstance(c, int) and c in (200, 503) for c in results), results
    new = wait_for(lambda: next((i for i in eng.state()["instances"] if i["role"] == "prefill"
                                 and i["status"] == "ready" and i["restarts"] == 1), None), 120,
                   "the prefill instance to come back")
    assert new["pid"] != pre["pid"]
    assert eng.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    st = wait_all_free(eng)
    assert httpx.get(eng.url + "/health", timeout=5).json()["status"] == "ok", st
