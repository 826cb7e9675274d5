"""Live cache-aware routing: engine instances publish the block names their prefix
cache adds and drops, the router keeps a summary per instance (core/prefix_summary.py), and the
``cache-aware`` / ``laps-pools`` routers of ``laneserve serve`` route by it."""

from __future__ import annotations

import random

import pytest

from laneserve.core.block_pool import REMOVED, STORED
from laneserve.core.kv import KVCacheManager
from laneserve.core.prefix_summary import PrefixSummary
from laneserve.core.request import Request
from laneserve.core.slo import SLO

from server_support import serving, wait_for

openai = pytest.importorskip("openai")

MODEL = "smoke-llama"
KV_TOKENS = 16384


def _req(rid: int, tokens: list[int]) -> Request:
    return Request(rid, 0.0, len(tokens), 4, SLO(), prompt_token_ids=list(tokens))


def test_summary_from_events_answers_as_the_manager_does():
    """Random sessions on a small prefix-caching manager (so eviction happens): after each change,
    a summary fed only the pool's events gives every probe the cached prefix the manager's own
    ``match`` finds."""
    rng = random.Random(7)
    kv = KVCacheManager(24, block_size=4, prefix_caching=True, cache_key=b"m")
    kv.allocator.record_events()
    summary = PrefixSummary(kv.block_size, kv.root)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 12))] for _ in range(4)]
    live: dict[int, Request] = {}
    probes: list[Request] = []
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 3):
            rid = rng.choice(sorted(live))
            del live[rid]
            kv.free(rid)
        else:
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(0, 14))]
            req = _req(step, tokens)
            cached = kv.match(req)
            if not kv.can_admit(step, len(tokens)):
                continue
            kv.allocate(step, len(tokens), cached=cached)
            req.num_computed_tokens = len(tokens)
            kv.register(req)
            live[step] = req
            probes.append(_req(10_000 + step, tokens + [1]))
        summary.apply(kv.allocator.take_events())
        for probe in probes[-6:]:
            assert summary.cached_tokens(probe) == len(kv.match(probe)) * kv.block_size
    assert kv.allocator.evicted > 0                     # the test went through evictions
    assert any(summary.cached_tokens(p) for p in probes)


def test_summary_events_order_and_restart():
    s = PrefixSummary(4, b"r" * 16)
    s.apply([(STORED, b"a"), (STORED, b"b"), (REMOVED, b"a"), (STORED, b"a"), (REMOVED, b"b")])
    assert s.names == {b"a"}
    s.clear()
    assert len(s) == 0


@pytest.fixture(scope="module")
def cache_aware_server():
    with serving("--prefill", "2", "--decode", "1", "--router-policy", "cache-aware", "--kv-tokens", str(KV_TOKENS)) as server:
        yield server


def test_cache_aware_router_sends_later_turns_to_the_instance_holding_their_history(cache_aware_server):
    """Four sessions with distinct long system prompts: first turns spread over both prefill
    instances (the router balances load when nothing is cached); every second turn then goes to
    the instance whose summary holds its history and finds it cached (sent in reverse order, so
    that balancing by load alone would put some on the other instance)."""
    server = cache_aware_server
    client = server.client()
    sessions, prompt_tokens = [], []
    for k in range(4):
        system = f"session {k} keeps its own long system prompt about topic {k}. " * 10
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"question {k}"}]
        one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
        sessions.append(msgs + [{"role": "assistant", "content": one.choices[0].message.content},
                                {"role": "user", "content": "go on"}])
        prompt_tokens.append(one.usage.prompt_tokens)

    def summaries():
        prefill = [i for i in server.state()["instances"] if i["role"] == "prefill"]
        blocks = [i["prefix_blocks"] or 0 for i in prefill]
        block_size = KV_TOKENS // prefill[0]["kv_total_blocks"]
        every_session = sum(n // block_size for n in prompt_tokens)
        return blocks if all(b > 0 for b in blocks) and sum(blocks) >= every_session else None
    # both prefill instances served first turns and the router heard all they now hold (the
    # summaries lag the caches: waiting for "both non-empty" alone raced the last session's news)
    wait_for(summaries, 30, "router summaries of every first turn's cached prompt")
    for msgs in reversed(sessions):      # another order than the first turns': load balancing alone would miss
        two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert two.usage.prompt_tokens_details.cached_tokens >= 64, two.usage
