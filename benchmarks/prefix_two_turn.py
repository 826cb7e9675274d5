"""Prefix caching through the live server: a two-turn chat with a long system prompt
against ``laneserve serve`` (1 prefill + 1 decode instance, the embedded smoke model on CPU), with
prefix caching on (the default) and off (``--no-prefix-caching``). For turn 2 — the system prompt,
turn 1's question and reply, and a new question — it reports the prompt tokens, the tokens found
cached (``usage.prompt_tokens_details.cached_tokens``), the tokens recomputed (the difference) and
the TTFT seen by a streaming client, over ``CHATS`` chats with different questions (token counts
summed, TTFT median); and
the ``/metrics`` prefix-cache counters. Turn 1 of every chat is sent first, so that turn 2 finds it.

    PYTHONPATH=. flock /tmp/laneserve-bench.lock .venv/bin/python benchmarks/prefix_two_turn.py
"""

from __future__ import annotations

import json
import statistics
import time

import httpx

from laneserve.bench.live_server import Server
from laneserve.bench.results import markdown_table, write_result

MODEL = "smoke-llama"
SYSTEM = ("You are the support assistant of a company that sells serving software for large language models. "
          "Answer briefly and precisely, cite the manual section when you can, never invent features, and "
          "ask a clarifying question when the request is ambiguous. ") * 6
QUESTIONS = ["How do I enable prefix caching?", "What does the decode instance do?",
             "Why is my first token slow?", "Can I run two prefill instances?", "What is a KV block?"]
CHATS = len(QUESTIONS)


def _chat(url: str, messages: list[dict], max_tokens: int) -> tuple[str, dict, float]:
    """Stream one chat completion: (reply text, usage, TTFT seconds)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    text, usage, ttft = "", {}, None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += piece
    return text, usage, ttft or 0.0


def _prefix_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in ("laneserve:prefix_cache_queries_total", "laneserve:prefix_cache_hits_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def run(caching: bool) -> dict:
    server = Server("--prefill", "1", "--decode", "1", "--kv-tokens", "16384",
                    *([] if caching else ["--no-prefix-caching"]))
    try:
        server.wait_ready()
        turn2 = []
        for q in QUESTIONS:
            first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            reply, usage1, _ = _chat(server.url, first, 16)
            second = first + [{"role": "assistant", "content": reply},
                              {"role": "user", "content": "Thanks. And what should I check next?"}]
            _, usage2, ttft = _chat(server.url, second, 16)
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            turn2.append({"turn1_prompt": usage1["prompt_tokens"], "prompt": usage2["prompt_tokens"],
                          "cached": cached, "recomputed": usage2["prompt_tokens"] - cached, "ttft_s": ttft})
        counters = _prefix_counters(server.url)
    finally:
        server.stop()
    return {"caching": caching, "turn2": turn2,
            "prompt_tokens": sum(t["prompt"] for t in turn2),
            "recomputed_tokens": sum(t["recomputed"] for t in turn2),
            "cached_tokens": sum(t["cached"] for t in turn2),
            "ttft_turn2_s": statistics.median(t["ttft_s"] for t in turn2),
            "queries_total": counters.get("laneserve:prefix_cache_queries_total", 0.0),
            "hits_total": counters.get("laneserve:prefix_cache_hits_total", 0.0)}


def main() -> None:
    on, off = run(True), run(False)
    rows = [{"prefix caching": "on" if r["caching"] else "off", "turn-2 prompt tokens (sum)": r["prompt_tokens"],
             "cached (sum)": r["cached_tokens"], "recomputed (sum)": r["recomputed_tokens"],
             "turn-2 TTFT (s, median)": r["ttft_turn2_s"], "/metrics queries": r["queries_total"],
             "/metrics hits": r["hits_total"]} for r in (on, off)]
    metrics = {"chats": CHATS, "turn2_prompt_tokens": on["prompt_tokens"],
               "turn2_recomputed_tokens_caching": on["recomputed_tokens"],
               "turn2_recomputed_tokens_no_caching": off["recomputed_tokens"],
               "turn2_ttft_s_caching": on["ttft_turn2_s"], "turn2_ttft_s_no_caching": off["ttft_turn2_s"],
               "hit_rate_caching": on["hits_total"] / on["queries_total"] if on["queries_total"] else 0.0}
    note = (f"Token counts summed, TTFT median, over {CHATS} two-turn chats (one question each, turn 2 after "
            "turn 1's reply), 1P+1D, "
            "smoke model (random weights, byte-level tokenizer), CPU. The hit rate counts both turns (every turn 1 "
            "after the first chat finds the system prompt). TTFTs were taken on the shared 2-core machine under "
            "the other agents' load: indicative only; the token counts are the figure.\n")
    write_result("prefix_two_turn", metrics, markdown=note + "\n" + markdown_table(rows),
                 extra={"runs": [on, off]})
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
