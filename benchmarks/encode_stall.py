"""How long the event loop waits while a large response body is encoded in a worker thread:
one ``json.dumps`` (what the server did) against ``laneserve.server.encode.encode_json`` (what it
does now), in the same process and on the same bodies.

An asyncio loop runs a ticker (``asyncio.sleep(0.005)`` in a loop, as ``/health`` would be
answered) while the body is encoded in a thread; the longest gap between two ticks is the worst
``/health`` delay the encoding causes. Bodies: the shapes the issue measured, an echo of a 4K
prompt with top-20 logprobs over 9 choices (~18 MB) and prompt logprobs top-20 over 8 prompts of
2K tokens (~23 MB), built synthetically (same structure, random values). Reported per body: the
bytes, the encode time and the longest loop gap for each encoder, and the ratio of the gaps.
Target: the piecewise encoder's longest gap <= 50 ms (a tenth of the 0.5 s /health budget).

    python benchmarks/encode_stall.py
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from laneserve.bench.results import markdown_table, write_result
from laneserve.server.encode import encode_json


def _top(rng: random.Random, k: int) -> dict:
    return {f"tok{rng.randrange(50_000)}": -rng.random() * 10 for _ in range(k)}


def echo_body(rng: random.Random, prompt: int = 4096, choices: int = 9, k: int = 20) -> dict:
    def block():
        return {"tokens": [f"tok{rng.randrange(50_000)}" for _ in range(prompt)],
                "token_logprobs": [None] + [-rng.random() for _ in range(prompt - 1)],
                "top_logprobs": [None] + [_top(rng, k) for _ in range(prompt - 1)],
                "text_offset": list(range(prompt))}
    return {"id": "cmpl-x", "object": "text_completion", "choices": [
        {"index": i, "text": "x" * prompt, "logprobs": block(), "finish_reason": "length"} for i in range(choices)]}


def prompt_logprobs_body(rng: random.Random, prompts: int = 8, length: int = 2048, k: int = 20) -> dict:
    def entry():
        return {str(rng.randrange(50_000)): {"logprob": -rng.random(), "rank": r, "decoded_token": "tok"}
                for r in range(1, k + 2)}
    return {"id": "cmpl-y", "choices": [{"index": i, "text": "y", "prompt_logprobs": [None] + [
        entry() for _ in range(length - 1)]} for i in range(prompts)]}


def _old(body) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _measure(encode, body) -> tuple[float, float, int]:
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    done = False

    async def ticker():
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    out = await loop.run_in_executor(None, encode, body)
    wall = time.perf_counter() - t0
    done = True
    await tick
    return wall, max(gaps), len(out)


def main() -> int:
    rng = random.Random(0)
    rows = []
    for name, body in (("echo_4k_top20_n9", echo_body(rng)), ("prompt_logprobs_8x2k_top20", prompt_logprobs_body(rng))):
        row = {"body": name}
        for label, enc in (("json_dumps", _old), ("encode_json", encode_json)):
            best = min((asyncio.run(_measure(enc, body)) for _ in range(3)), key=lambda r: r[1])
            row[f"{label}_s"], row[f"{label}_max_gap_ms"], row["mb"] = best[0], best[1] * 1e3, best[2] / 1e6
        row["gap_ratio"] = row["json_dumps_max_gap_ms"] / row["encode_json_max_gap_ms"]
        print(row, file=sys.stderr, flush=True)
        rows.append(row)
    metrics = {**{f"{r['body']}_{k}": round(v, 3) for r in rows for k, v in r.items() if k != "body"},
               "targets_met": all(r["encode_json_max_gap_ms"] <= 50 for r in rows)}
    md = ("Longest event-loop gap (a ticker every 5 ms) while one body is encoded in a worker thread; "
          "best of 3 runs each.\n\n" + markdown_table(rows, floatfmt=".3g"))
    write_result("encode_stall", metrics, markdown=md, command="python benchmarks/encode_stall.py")
    print(json.dumps(metrics, indent=1))
    return 0 if metrics["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
