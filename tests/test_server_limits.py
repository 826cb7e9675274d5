"""What one request or one connection may take of a live server: response amplification and
admission shares are refused before any work with a 400 naming the limit; connections that send
nothing, or their headers too slowly, are closed; bodies cut short, HEAD, unknown paths and
methods get clean answers; start-up failures exit with one line; a drain past its deadline ends
streams with an SSE error event."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_support import TIMEOUT, Server, serving, wait_all_free, wait_for

MODEL = "smoke-llama"


@pytest.fixture(scope="module")
def server():
    with serving("--prefill", "1", "--decode", "1", "--header-timeout", "1", "--keep-alive-timeout", "1",
                 "--body-timeout", "2", "--max-response-bytes", str(8 << 20)) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def test_response_amplification_is_refused_before_the_work(server):
    # echo + top-20 logprobs + top-20 prompt logprobs over 40 prompts of 4,000 token ids
    prompts = [[(i * 7 + k) % 1000 + 3 for k in range(4000)] for i in range(40)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 16, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "--max-response-bytes" in err["message"] and err["param"] == "prompt_logprobs"
    assert server.state()["in_flight"] == 0                   # nothing was admitted
    # the same request at a size under the cap is served, its body as large as estimated at most
    small = {**body, "prompt": prompts[0][:200], "max_tokens": 4}
    r = post(server, "/v1/completions", small)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 204 and len(r.json()["choices"][0]["prompt_logprobs"]) == 200
    from laneserve.server.budget import response_bytes
    assert len(r.content) <= response_bytes([200], 1, 4, 20, 20, True)
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_one_request_cannot_take_every_admission_slot_or_the_kv(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "best_of": 128, "max_tokens": 4000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "best_of" and "--max-request-share" in err["message"] and "64 of the 256" in err["message"]
    # within the slot share but over the KV share: 60 samples x 3,000 tokens
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello", "n": 60, "max_tokens": 3000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "KV" in r.json()["error"]["message"]
    # a request within both shares is served while the refused ones took nothing
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello", "n": 4, "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    wait_all_free(server)


def test_head_and_openai_shaped_404_and_405(server):
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(server.url + path, timeout=TIMEOUT)
        assert r.status_code == 200 and r.content == b""
    r = httpx.get(server.url + "/v1/nothing-here", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.delete(server.url + "/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert "POST" in r.headers.get("allow", "")


def _raw(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def test_idle_and_slow_header_connections_are_closed(server):
    idle = _raw(server)                                           # sends nothing at all
    slow = _raw(server)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")           # headers never finish
    for sock in (idle, slow):
        sock.settimeout(15)
        assert _closed_by_server(sock), "the server kept a connection that sent no complete headers"
        sock.close()
    # a prompt client on a fresh connection is unaffected
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_a_body_cut_short_or_too_slow_is_answered_cleanly(server):
    sock = _raw(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 500\r\n\r\n{\"model\": ")
    sock.settimeout(15)
    reply = sock.recv(65536)                                      # the body never completes: 408
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    sock.close()
    sock = _raw(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 500\r\n\r\n{\"model\": ")
    sock.close()                                                   # the client goes away mid-body
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_the_port_answers_starting_before_the_instances_are_up():
    s = Server("--prefill", "1", "--decode", "1")
    try:
        seen = []

        def answered():
            if s.proc.poll() is not None:
                raise AssertionError(f"server exited: {s.proc.stderr.read()}")
            try:
                r = httpx.get(s.url + "/health", timeout=2)
            except httpx.HTTPError:
                return None
            seen.append((r.status_code, r.json().get("status"), r.headers.get("retry-after")))
            return True
        wait_for(answered, 150, "the port to answer", interval=0.05)
        # the first answer comes while the instances load (they take seconds): 503 "starting"
        assert seen[0][:2] == (503, "starting") and seen[0][2] is not None, seen
    finally:
        s.stop()


def test_a_start_up_failure_exits_promptly_with_one_line():
    # float16 is CUDA-only: the in-process instance fails as it loads
    proc = subprocess.run([sys.executable, "-m", "laneserve.cli", "serve", "--colocated", "--in-process",
                           "--dtype", "fp16", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "float16" in errors[0], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "laneserve.cli", "serve", "--dtype", "fp64"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "unknown dtype" in proc.stderr and "Traceback" not in proc.stderr


def test_a_drain_past_its_deadline_ends_streams_with_an_error_event():
    s = Server("--stub", "--stub-token-delay", "0.05", "--shutdown-timeout", "1")
    try:
        s.wait_ready()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": "laneserve-stub", "prompt": [5] * 8, "max_tokens": 2000, "stream": True,
                                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        s.proc.send_signal(signal.SIGTERM)        # drain: 1 s for a 100 s stream
                        break
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert "shutdown-timeout" in err["error"]["message"]
        assert s.proc.wait(timeout=60) == 0
        assert "Traceback" not in s.proc.stderr.read()
    finally:
        s.stop()


def test_health_stays_quick_while_a_large_allowed_response_is_built(server):
    """The large response is built off the event loop: /health answers while it is built."""
    prompts = [[(i * 5 + k) % 1000 + 3 for k in range(1000)] for i in range(2)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    import threading
    out = {}
    t = threading.Thread(target=lambda: out.update(r=post(server, "/v1/completions", body)))
    t.start()
    healthy = []
    while t.is_alive():
        healthy.append(httpx.get(server.url + "/health", timeout=TIMEOUT).status_code)
        time.sleep(0.05)
    t.join()
    assert out["r"].status_code == 200, out["r"].text
    assert len(out["r"].json()["choices"]) == 2
    assert healthy and all(code == 200 for code in healthy)
