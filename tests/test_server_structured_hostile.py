"""The hostile structured-output list against a live 1P+1D server: the schemas and regexes that
blow up an automaton (nested bounded arrays, long maxLength, ``(a|b)*a(a|b){N}``), keywords that
used to be silently ignored, and generated schemas and regexes. Every request gets a 400 or a
document that satisfies its constraint; an ordinary request sent meanwhile is served; no
instance restarts."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx

from laneserve.bench.hostile import chat_body, judge, structured_cases
from server_support import TIMEOUT, wait_all_free

MODEL = "smoke-llama"


def test_hostile_structured_requests_are_refused_or_enforced_and_the_server_lives(shared_server):
    cases = structured_cases(random.Random(7), generated=24)
    # the session's 1P+1D server (tests/conftest.py); its KV (16,384 tokens per instance) holds
    # every case here many times over
    server = shared_server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384")
    server.wait_ready()

    def send(case):
        name, path, fields = case
        r = httpx.post(server.url + path, json=chat_body(MODEL, fields, max_tokens=64, seed=len(name)),
                       timeout=TIMEOUT)
        return name, fields, r.status_code, r.json()

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, c) for c in cases]
        ordinary = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json=chat_body(
            MODEL, {"response_format": {"type": "json_object"}}, max_tokens=8))
        results = [f.result() for f in futures]
    assert ordinary.status_code == 200
    verdicts = {name: judge(fields, status, body) for name, fields, status, body in results}
    wrong = {n: v for n, v in verdicts.items() if v.startswith("wrong")}
    assert not wrong, wrong
    for name in ("schema:unique_items", "schema:lookahead_pattern", "regex:backreference", "regex:word_boundary"):
        assert verdicts[name] == "refused", (name, verdicts[name])
    refuse = [name for name in verdicts if name.startswith("refuse:")]      # cannot run: refused before admission
    assert refuse and all(verdicts[name] == "refused" for name in refuse), {n: verdicts[n] for n in refuse}
    for name in ("schema:nested_arrays", "schema:max_length_2000", "schema:int_range", "regex:ab_tail_40"):
        assert verdicts[name] != "refused", (name, verdicts[name])
    assert sum(v == "valid" for v in verdicts.values()) >= 10, verdicts
    health = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and all(i["restarts"] == 0 for i in health["instances"]), health
    wait_all_free(server)
