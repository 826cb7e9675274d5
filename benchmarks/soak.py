"""Soak test of ``laneserve serve``: a few thousand requests over a few minutes against a
live 1P+1D deployment of the smoke model, mixing

- valid requests (streamed and not, completions and chat, 2-24 output tokens),
- hostile bodies (NaN/Infinity, integers beyond 64 bits, lone surrogates, 5,000-deep nesting,
  100k-digit numbers, bodies over ``--max-request-bytes``, garbage),
- client disconnects at random phases (before the response starts, mid-stream, during a
  non-streamed wait),
- hostile structured output (``laneserve.bench.hostile``: schemas and regexes that blow up an
  automaton, keywords a grammar engine may ignore, generated schemas and regexes; each answer
  must be a 400 or a document satisfying its constraint), response amplification (echo + top-20
  logprobs + top-20 prompt logprobs over 40 prompts of 4,000 tokens) and a request asking for every
  admission slot (``best_of: 128`` over two prompts), each to be refused with a 400,
- round four's classes (``ROUND4_OK``): a 300 KB ``/tokenize`` prompt and 320 KB of tools (400s
  before any tokenizer or template work), duplicate tool names, ``allowed_token_ids=[EOS]`` with
  ``min_tokens``, a chat template that loops (the server runs with one that loops on "loop" and
  ``--chat-template-timeout 1``: a 400 that frees the parse thread), a large echo + top-20 logprobs
  body (encoded in pieces off the loop), a named tool call cut by ``max_tokens`` (its partial
  call) and a tool call whose arguments hold a lone surrogate (escaped, never a 500),

while the decode instance is killed (SIGKILL) a third of the way in and the prefill instance is
hung (SIGSTOP) two thirds of the way in. A poller times ``/health`` every 100 ms all along.

Reported (``benchmarks/results/soak.json``):
- ``requests_lost``: requests the server accepted (it started answering, or the client was
  waiting) that never got an answer — neither tokens to the end nor an error. Must be 0.
- ``hostile_5xx``: hostile bodies answered with a 5xx. Must be 0.
- ``structured_wrong``: structured-output answers that are neither a 400 nor a document that
  satisfies the constraint. Must be 0. ``amplify_not_400`` / ``slot_hog_not_400``: those requests
  answered otherwise than a 400. Must be 0.
- ``kv_blocks_leaked``, ``inflight_at_rest``, ``kv_files_at_rest``: what is still held once the
  load has stopped and the server is at rest. Must be 0.
- ``restarts``: instance restarts the supervisor made (2 expected: the kill and the hang).
- ``round4_wrong``: round-four requests answered otherwise than expected. Must be 0.
- RSS growth in MB of the API process and of each instance process alive at the end, from the
  first sample after warm-up to the end; ``/health`` p50/p99/max latency during the run.

    python benchmarks/soak.py [--requests 3000] [--rate 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter

import httpx

from laneserve.bench.hostile import amplification_body, chat_body, judge, slot_hog_body, structured_cases
from laneserve.bench.live_server import Server, rss_mb  # noqa: E402
from laneserve.bench.results import markdown_table, write_result  # noqa: E402

MODEL = "smoke-llama"
MAX_REQUEST_BYTES = 1 << 20
HOSTILE = [
    b'{"model": "smoke-llama", "prompt": "hi", "temperature": NaN}',
    b'{"model": "smoke-llama", "prompt": "hi", "top_p": NaN}',
    b'{"model": "smoke-llama", "prompt": "hi", "temperature": 1e999}',
    b'{"model": "smoke-llama", "prompt": "hi", "seed": 18446744073709551616}',
    b'{"model": "smoke-llama", "prompt": "hi", "top_k": 18446744073709551617}',
    b'{"model": "smoke-llama", "prompt": "hi", "priority": 18446744073709551616}',
    b'{"model": "smoke-llama", "prompt": "hi", "stop_token_ids": [18446744073709551616]}',
    b'{"model": "smoke-llama", "prompt": "hi \\ud800"}',
    b'{"model": "smoke-llama", "messages": [{"role": "user", "content": "\\udc00"}]}',
    b'{"model": "smoke-llama", "prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "smoke-llama", "prompt": "hi", "max_tokens": ' + b"7" * 100_000 + b"}",
    b'{"model": "smoke-llama", "prompt": "' + b"x" * (MAX_REQUEST_BYTES + 10) + b'"}',
    b'{"model": "smoke-llama", "prompt": ',
    b"\xff\xfe\x00garbage",
]


# round four's request classes (sizes before the work, templates, tool calls, big bodies): name -> the
# statuses that are a right answer
ROUND4_OK = {"tokenize_huge": {400}, "tools_huge": {400}, "duplicate_tools": {400}, "eos_min_tokens": {400},
             "template_loop": {400}, "big_echo": {200, 400}, "named_cut": {200}, "surrogate_tool_args": {200}}
# a chat template that loops for hours on a message saying "loop" (bounded by --chat-template-timeout)
LOOPING_TEMPLATE = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                    "{% endfor %}<assistant>")
PING_TOOL = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}]


def round4_request(name: str, rng: random.Random, eos: int) -> tuple[str, dict]:
    """(path, body) of one round-four request."""
    user = [{"role": "user", "content": "hello"}]
    chat = "/v1/chat/completions"
    if name == "tokenize_huge":
        return "/tokenize", {"prompt": "word " * 60_000}
    if name == "tools_huge":
        tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 40_000}} for i in range(8)]
        return chat, {"model": MODEL, "messages": user, "tools": tools, "tool_choice": "none", "max_tokens": 4}
    if name == "duplicate_tools":
        return chat, {"model": MODEL, "messages": user, "tools": PING_TOOL * 2, "tool_choice": "required"}
    if name == "eos_min_tokens":
        return chat, {"model": MODEL, "messages": user, "allowed_token_ids": [eos], "min_tokens": 4, "max_tokens": 8}
    if name == "template_loop":
        return chat, {"model": MODEL, "messages": [{"role": "user", "content": "loop"}], "max_tokens": 4}
    if name == "big_echo":
        return "/v1/completions", {"model": MODEL, "prompt": [rng.randrange(4, 1000) for _ in range(1500)],
                                   "echo": True, "logprobs": 20, "n": 4, "max_tokens": 4, "ignore_eos": True}
    if name == "named_cut":
        return chat, {"model": MODEL, "messages": user, "tools": PING_TOOL, "max_tokens": 3,
                      "tool_choice": {"type": "function", "function": {"name": "ping"}}}
    call = '<tool_call>\\{"name": "ping", "arguments": \\{"s": "\\\\ud800"\\}\\}</tool_call>'
    return chat, {"model": MODEL, "messages": user, "tools": PING_TOOL, "guided_regex": call, "max_tokens": 60}


def round4_right(name: str, status: int, body) -> bool:
    if status not in ROUND4_OK[name]:
        return False
    if name == "named_cut" or name == "surrogate_tool_args":
        return bool(body["choices"][0]["message"].get("tool_calls"))
    return True


class Soak:
    def __init__(self, url: str, server_pid: int, n: int, rate: float, seed: int) -> None:
        self.url, self.server_pid, self.n, self.rate = url, server_pid, n, rate
        self.rng = random.Random(seed)
        self.structured = structured_cases(random.Random(seed + 1), generated=60)
        self.outcomes: Counter = Counter()
        self.lost: list[str] = []
        self.health_ms: list[float] = []
        self.health_bad = 0
        self.rss_first: dict[int, tuple[str, float]] = {}
        self.rss_last: dict[int, float] = {}
        self.final_pids: set[int] = set()
        self.events: list[str] = []
        self.done = False
        self.eos = 1

    # ---- one request -------------------------------------------------------------------
    def _valid_body(self) -> tuple[str, dict]:
        r = self.rng
        n_out = r.randint(2, 24)
        if r.random() < 0.3:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * r.randint(1, 60)}],
                    "max_tokens": n_out}
            path = "/v1/chat/completions"
        else:
            body = {"model": MODEL, "prompt": [r.randrange(4, 1000) for _ in range(r.randint(4, 600))],
                    "max_tokens": n_out}
            path = "/v1/completions"
        body["ignore_eos"] = True
        body["temperature"] = r.choice([0.0, 0.7, 1.0])
        if r.random() < 0.3:
            body["seed"] = r.randrange(0, 2**63)
        return path, body

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        r = self.rng
        kind = r.choices(["stream", "json", "hostile", "disconnect", "structured", "amplify", "slot_hog", "round4"],
                         weights=[42, 17, 12, 12, 8, 2, 2, 5])[0]
        try:
            if kind == "round4":
                return await self._round4(client, i)
            if kind == "structured":
                name, path, fields = r.choice(self.structured)
                resp = await client.post(self.url + path, json=chat_body(MODEL, fields, max_tokens=48, seed=i))
                if resp.status_code in (429, 503):          # admitted or not while an instance is down
                    self.outcomes[f"refused_{resp.status_code}"] += 1
                    return
                if resp.status_code >= 500:
                    self.outcomes["hostile_5xx"] += 1
                    self.lost.append(f"{i} {name}: {resp.status_code} {resp.text[:120]}")
                    return
                verdict = judge(fields, resp.status_code, resp.json())
                self.outcomes["structured_wrong" if verdict.startswith("wrong") else f"structured_{verdict}"] += 1
                if verdict.startswith("wrong"):
                    self.lost.append(f"{i} {name}: {verdict}")
                return
            if kind in ("amplify", "slot_hog"):
                body = amplification_body(MODEL) if kind == "amplify" else slot_hog_body(MODEL)
                resp = await client.post(self.url + "/v1/completions", json=body)
                self.outcomes[f"{kind}_400" if resp.status_code == 400 else f"{kind}_not_400"] += 1
                if resp.status_code >= 500:
                    self.outcomes["hostile_5xx"] += 1
                return
            if kind == "hostile":
                raw = r.choice(HOSTILE)
                path = "/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"
                resp = await client.post(self.url + path, content=raw, headers={"content-type": "application/json"})
                self.outcomes["hostile_5xx" if resp.status_code >= 500 else f"hostile_{resp.status_code}"] += 1
                return
            path, body = self._valid_body()
            if kind == "json":
                resp = await client.post(self.url + path, json=body)
                self._judge_json(resp, i)
                return
            body["stream"] = True
            cut = None if kind == "stream" else r.choice(["before", "mid", "mid", "json"])
            if cut == "json":                           # a non-streamed request abandoned while waiting
                body.pop("stream")
                try:
                    await client.post(self.url + path, json={**body, "max_tokens": 200},
                                      timeout=r.uniform(0.01, 0.5))
                except httpx.TimeoutException:
                    pass
                self.outcomes["disconnected"] += 1
                return
            if cut == "before":
                task = asyncio.ensure_future(client.post(self.url + path, json=body))
                await asyncio.sleep(r.uniform(0.0, 0.05))
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, httpx.HTTPError):
                    pass
                self.outcomes["disconnected"] += 1
                return
            await self._stream(client, path, body, i, stop_after=r.randint(1, 6) if cut == "mid" else None)
        except httpx.HTTPError as exc:
            self.outcomes["lost"] += 1
            self.lost.append(f"{i} {kind}: {exc!r}")

    async def _round4(self, client: httpx.AsyncClient, i: int) -> None:
        name = self.rng.choice(sorted(ROUND4_OK))
        path, body = round4_request(name, self.rng, self.eos)
        resp = await client.post(self.url + path, json=body)
        if resp.status_code in (429, 503) and 200 in ROUND4_OK[name]:
            self.outcomes[f"refused_{resp.status_code}"] += 1         # admitted or not while an instance is down
            return
        right = round4_right(name, resp.status_code, resp.json())
        self.outcomes[f"round4_{name}" if right else "round4_wrong"] += 1
        self.outcomes["hostile_5xx"] += resp.status_code >= 500
        if not right:
            self.lost.append(f"{i} round4 {name}: {resp.status_code} {resp.text[:120]}")

    def _judge_json(self, resp: httpx.Response, i: int) -> None:
        if resp.status_code == 200 and resp.json().get("choices"):
            self.outcomes["ok"] += 1
        elif resp.status_code in (429, 503):
            self.outcomes[f"refused_{resp.status_code}"] += 1     # admission said no: an answer
        elif resp.status_code in (500, 503) and "error" in resp.json():
            self.outcomes["failed_with_error"] += 1
        else:
            self.outcomes["lost"] += 1
            self.lost.append(f"{i} json: {resp.status_code} {resp.text[:120]}")

    async def _stream(self, client, path: str, body: dict, i: int, stop_after: int | None) -> None:
        async with client.stream("POST", self.url + path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                if resp.status_code in (429, 503):
                    self.outcomes[f"refused_{resp.status_code}"] += 1
                else:
                    self.outcomes["lost"] += 1
                    self.lost.append(f"{i} stream: status {resp.status_code}")
                return
            seen, last, error = 0, None, False
            async for line in resp.aiter_lines():
                if not line:
                    continue
                last = line
                error |= line.startswith("data: {") and '"error"' in line
                seen += 1
                if stop_after is not None and seen >= stop_after:
                    self.outcomes["disconnected"] += 1
                    return                                 # leaving the block closes the connection
        if last == "data: [DONE]":
            self.outcomes["failed_with_error" if error else "ok"] += 1
        else:
            self.outcomes["lost"] += 1
            self.lost.append(f"{i} stream ended without [DONE]: {last!r}")

    # ---- background pollers ---------------------------------------------------------------
    async def poll_health(self, client: httpx.AsyncClient) -> None:
        while not self.done:
            t = time.perf_counter()
            try:
                resp = await client.get(self.url + "/health", timeout=10)
                self.health_bad += resp.status_code != 200
            except httpx.HTTPError:
                self.health_bad += 1
            self.health_ms.append((time.perf_counter() - t) * 1e3)
            await asyncio.sleep(0.1)

    async def state(self, client: httpx.AsyncClient) -> dict:
        return (await client.get(self.url + "/debug/state", timeout=10)).json()

    async def sample_rss(self, client: httpx.AsyncClient) -> None:
        st = await self.state(client)
        procs = [("api", self.server_pid)] + [(f"{i['role']}{i['id']}.gen{i['restarts']}", i["pid"])
                                              for i in st["instances"] if i["pid"] and i["status"] == "ready"]
        self.final_pids = set()
        for name, pid in procs:
            v = rss_mb(pid)
            if v is None:
                continue
            self.rss_first.setdefault(pid, (name, v))
            self.rss_last[pid] = v
            self.final_pids.add(pid)

    async def chaos(self, client: httpx.AsyncClient, duration: float) -> None:
        """Kill the decode instance at 1/3 of the run, SIGSTOP the prefill instance at 2/3."""
        await asyncio.sleep(duration / 3)
        st = await self.state(client)
        dec = next(i for i in st["instances"] if i["role"] == "decode")
        os.kill(dec["pid"], signal.SIGKILL)
        self.events.append(f"t={duration / 3:.0f}s SIGKILL decode pid {dec['pid']}")
        await asyncio.sleep(duration / 3)
        st = await self.state(client)
        pre = next(i for i in st["instances"] if i["role"] == "prefill")
        os.kill(pre["pid"], signal.SIGSTOP)
        self.events.append(f"t={2 * duration / 3:.0f}s SIGSTOP prefill pid {pre['pid']}")

    async def run(self) -> dict:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            eos = await client.post(self.url + "/tokenize", json={"prompt": "</s>", "add_special_tokens": False})
            self.eos = eos.json()["tokens"][0]
            warm = [self.one(client, -k) for k in range(20)]
            await asyncio.gather(*warm)
            self.outcomes.clear()
            await self.sample_rss(client)
            duration = self.n / self.rate
            health = asyncio.ensure_future(self.poll_health(client))
            chaos = asyncio.ensure_future(self.chaos(client, duration))
            tasks, t0 = [], time.perf_counter()
            next_rss = t0
            for i in range(self.n):
                await asyncio.sleep(self.rng.expovariate(self.rate))
                tasks.append(asyncio.ensure_future(self.one(client, i)))
                if time.perf_counter() >= next_rss:
                    await self.sample_rss(client)
                    next_rss += 10
                if i % 500 == 0:
                    print(f"soak: {i}/{self.n} sent, {dict(self.outcomes)}", file=sys.stderr, flush=True)
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            await chaos
            self.done = True
            await health
            rest = await self.at_rest(client)
            await self.sample_rss(client)
        return {"wall_s": wall, **rest}

    async def at_rest(self, client: httpx.AsyncClient, timeout: float = 60.0) -> dict:
        """Wait (bounded) for both instances to be back and idle; what is still held then is a leak."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.state(client)
            insts = st["instances"]
            settled = (st["in_flight"] == 0 and all(i["status"] == "ready" for i in insts)
                       and all(i["kv_free_blocks"] == i["kv_total_blocks"] and not i["live_requests"] for i in insts))
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return {"state": st, "settled": settled,
                "kv_blocks_leaked": sum((i["kv_total_blocks"] or 0) - (i["kv_free_blocks"] or 0) for i in insts),
                "inflight_at_rest": st["in_flight"], "kv_files_at_rest": st["kv_files"],
                "restarts": st["restarts"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=15.0, help="request arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args()
    server = Server("--prefill", "1", "--decode", "1", "--max-inflight", "128", "--kv-tokens", "32768",
                    "--max-request-bytes", str(MAX_REQUEST_BYTES), "--heartbeat-timeout", str(args.heartbeat_timeout),
                    "--chat-template", LOOPING_TEMPLATE, "--chat-template-timeout", "1",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        server.wait_ready()
        soak = Soak(server.url, server.proc.pid, args.requests, args.rate, args.seed)
        out = asyncio.run(soak.run())
    finally:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.stop()
    h = sorted(soak.health_ms)
    rss_rows = [{"process": name, "pid": pid, "rss_first_mb": first, "rss_last_mb": soak.rss_last[pid],
                 "growth_mb": soak.rss_last[pid] - first} for pid, (name, first) in soak.rss_first.items()
                if pid in soak.final_pids]                     # processes alive at the end
    api = next((r for r in rss_rows if r["process"] == "api"), None)
    metrics = {
        "requests": args.requests, "rate_per_s": args.rate, "wall_s": round(out["wall_s"], 1),
        "requests_lost": soak.outcomes["lost"], "hostile_5xx": soak.outcomes["hostile_5xx"],
        "structured_wrong": soak.outcomes["structured_wrong"], "amplify_not_400": soak.outcomes["amplify_not_400"],
        "slot_hog_not_400": soak.outcomes["slot_hog_not_400"], "round4_wrong": soak.outcomes["round4_wrong"],
        "kv_blocks_leaked": out["kv_blocks_leaked"], "inflight_at_rest": out["inflight_at_rest"],
        "kv_files_at_rest": out["kv_files_at_rest"], "restarts": out["restarts"], "settled": out["settled"],
        "api_rss_growth_mb": round(api["growth_mb"], 1) if api else None,
        "max_instance_rss_growth_mb": round(max((r["growth_mb"] for r in rss_rows if r["process"] != "api"),
                                                default=0.0), 1),
        "health_p50_ms": round(statistics.median(h), 2), "health_p99_ms": round(h[int(0.99 * (len(h) - 1))], 2),
        "health_max_ms": round(h[-1], 2), "health_non_200": soak.health_bad,
        **{f"outcome_{k}": v for k, v in sorted(soak.outcomes.items())},
    }
    growth = [r["growth_mb"] for r in rss_rows]
    metrics["targets_met"] = bool(metrics["health_max_ms"] <= 500 and max(growth, default=0.0) <= 200
                                  and all(metrics[k] == 0 for k in ("requests_lost", "hostile_5xx", "round4_wrong")))
    md = ("## Chaos\n\n" + "\n".join(f"- {e}" for e in soak.events) + "\n\n## Processes (RSS, MB)\n\n"
          + markdown_table(rss_rows, floatfmt=".1f") + "\n## Outcomes\n\n"
          + markdown_table([{"outcome": k, "requests": v} for k, v in sorted(soak.outcomes.items())])
          + ("\n## Lost requests\n\n" + "\n".join(f"- {x}" for x in soak.lost[:50]) + "\n" if soak.lost else "")
          + "\n`/health` answers 503 only while no instance of a role is ready (between a crash and the restart): "
            "`health_non_200` counts those polls.\n")
    write_result("soak", metrics, markdown=md, extra={"events": soak.events, "lost": soak.lost[:200],
                                                      "final_state": out["state"], "rss": rss_rows},
                 results_dir=args.results_dir)
    print(json.dumps(metrics, indent=1))
    bad = ("requests_lost", "hostile_5xx", "structured_wrong", "amplify_not_400", "slot_hog_not_400", "round4_wrong")
    return 0 if all(metrics[k] == 0 for k in bad) else 1


if __name__ == "__main__":
    sys.exit(main())
