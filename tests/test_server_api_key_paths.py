"""Which paths the API key guards, in process (the edge guard answers before any handler runs):
every path that does work for a client (the OpenAI API, ``/tokenize``, ``/detokenize``,
``/debug``, unknown paths) needs it; ``/health``, ``/version`` and the docs stay open, and
``/metrics`` too unless ``--metrics-require-key``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from laneserve.cli import build_parser
from laneserve.commands.serve import build_server

KEY = "k3y"
GUARDED = [("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
           ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/debug/state"), ("GET", "/nowhere")]


def _statuses(flags: list[str], requests: list[tuple[str, str]], key: str | None = None) -> dict[str, int]:
    app, _ = build_server(build_parser().parse_args(["serve", "--stub", "--api-key", KEY, *flags]), log=lambda s: None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def run() -> dict[str, int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            out = {}
            for method, path in requests:
                r = await client.request(method, path, headers=headers, json={} if method == "POST" else None)
                out[f"{method} {path}"] = r.status_code
            return out
    return asyncio.run(run())


def test_every_working_path_needs_the_key():
    got = _statuses([], GUARDED)
    assert set(got.values()) == {401}, got


def test_open_paths_stay_open_and_head_version_is_answered():
    got = _statuses([], [("GET", "/health"), ("GET", "/version"), ("HEAD", "/version"), ("GET", "/metrics"),
                         ("GET", "/openapi.json")])
    assert 401 not in got.values() and 405 not in got.values(), got
    assert got["GET /version"] == got["HEAD /version"] == 200


@pytest.mark.parametrize("flag,open_paths", [("--metrics-require-key", ["/health", "/version"]),
                                              ("--api-key-all-paths", [])])
def test_metrics_and_all_paths_flags(flag, open_paths):
    paths = ["/health", "/version", "/metrics"]
    got = _statuses([flag], [("GET", p) for p in paths])
    for p in paths:
        assert (got[f"GET {p}"] != 401) == (p in open_paths), got
    with_key = _statuses([flag], [("GET", "/metrics")], key=KEY)
    assert with_key["GET /metrics"] != 401
