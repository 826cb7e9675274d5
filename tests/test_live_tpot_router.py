"""``laneserve serve``'s default decode placement: adaptive decode's own ``tpot-aware``
router (``--decode-router-policy auto``), fed by the instance processes. Each decode instance sends
the summary of its next step and its last pure decode step in its stats; the server's router fits
its online step model from those steps and predicts with it."""

from __future__ import annotations

import pytest

from laneserve.core.request import Request
from laneserve.core.slo import SLO
from laneserve.policies.routing import DecodeSummary

from server_support import serving, wait_for

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"


def test_decode_summary_travels_in_stats_and_sums_the_residents():
    reqs = [Request(i, 0.0, n, 8, SLO(1.0, t)) for i, (n, t) in enumerate([(100, 0.05), (300, 0.05), (50, 0.1), (70, None)])]
    s = DecodeSummary.of(reqs)
    assert (s.count, s.total, s.longest) == (4, 520, 300)
    assert dict(s.tpots) == {0.05: 2, 0.1: 1}                   # no target: not counted
    assert DecodeSummary.from_wire(s.to_wire()) == s
    assert DecodeSummary.of([]) == DecodeSummary()


def test_serve_places_decode_by_the_tpot_aware_router_learning_from_reported_steps():
    with serving("--prefill", "1", "--decode", "2", "--kv-tokens", "8192") as server:
        state = server.state()
        assert state["decode_policy"] == "adaptive" and state["decode_router"] == "tpot-aware"
        assert state["decode_router_steps"] == 0
        client = server.client()

        def ask(k: int) -> None:
            out = client.completions.create(model=MODEL, prompt=f"request {k} " * 12, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 12

        for k in range(2):               # with least-loaded ties, the two go to both decode instances
            ask(k)

        def reported():
            decoders = [i for i in server.state()["instances"] if i["role"] == "decode"]
            return all((i["decode_steps_reported"] or 0) >= 1 for i in decoders)
        wait_for(reported, 30, "both decode instances reporting a decode step")
        ask(2)                           # this placement reads the reported steps
        assert server.state()["decode_router_steps"] >= 1
