"""Chat templates held to account, on live servers of the smoke model: a template that does not
compile, or compiles but fails on a one-message conversation, stops start-up with one line and
exit code 2; a template that loops fails only the requests that make it loop (a 400 after
``--chat-template-timeout``), frees its parse thread (later requests are served) and SIGTERM still
ends the server within ``--shutdown-timeout``."""

from __future__ import annotations

import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_support import TIMEOUT, Server

MODEL = "smoke-llama"
# loops for hours, but only on a message that says "loop"
LOOPING = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
           "<assistant>")


def _exit(server: Server, timeout: float) -> tuple[int, str]:
    code = server.proc.wait(timeout=timeout)           # raises if it does not end in time
    return code, server.proc.stderr.read()


def test_a_template_that_does_not_compile_stops_start_up():
    code, err = _exit(Server("--colocated", "--chat-template", "{% for x in %}"), 60)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--chat-template does not compile: line 1" in lines[0], err
    assert "Traceback" not in err


def test_a_template_that_fails_to_render_stops_start_up():
    code, err = _exit(Server("--colocated", "--chat-template", "{{ messages[0].content | no_such_filter }}"),
                      120)
    assert code == 2 and "Traceback" not in err, err
    assert "fails on a one-message conversation" in err, err


def test_a_looping_template_fails_its_requests_and_frees_its_threads():
    srv = Server("--colocated", "--kv-tokens", "4096", "--chat-template", LOOPING, "--chat-template-timeout", "1",
                 "--shutdown-timeout", "5")
    try:
        srv.wait_ready()

        def chat(content: str) -> httpx.Response:
            return httpx.post(srv.url + "/v1/chat/completions", timeout=TIMEOUT, json={
                "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})

        with ThreadPoolExecutor(4) as pool:           # more than the two parse threads
            looped = list(pool.map(chat, ["loop"] * 4))
        for r in looped:
            assert r.status_code == 400, r.text[:300]
            assert "longer than 1 s" in r.json()["error"]["message"]
        tok = httpx.post(srv.url + "/tokenize", timeout=TIMEOUT, json={"messages": [{"role": "user", "content": "loop"}]})
        assert tok.status_code == 400
        ok = chat("hello")
        assert ok.status_code == 200, ok.text[:300]
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
        # a render is running when SIGTERM arrives: the server still ends, in time
        with ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(chat, "loop") for _ in range(2)]
            srv.proc.send_signal(signal.SIGTERM)
            code = srv.proc.wait(timeout=5 + 15)
            for f in pending:
                try:
                    f.result()
                except httpx.HTTPError:
                    pass
        assert code == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(timeout=10)
        try:
            srv.proc.stderr.close()
        except (OSError, subprocess.SubprocessError):
            pass
