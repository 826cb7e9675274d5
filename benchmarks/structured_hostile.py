"""Hostile structured output: which grammar engine, and what a live server does with the bombs.

1. **Engines on the bomb list** (offline, the smoke model's 1,024-token byte-level vocabulary):
   time to compile/check each spec and to compute its first 32 token masks, for llguidance (the
   engine laneserve uses) and, where installed, outlines-core (the previous one) and xgrammar.
   Each engine runs each spec in a child process with a 20 s limit and a 4 GiB address-space
   limit, so a blow-up is recorded as ``timeout`` / ``out of memory`` instead of taking the
   benchmark down.
2. **A live 1P+1D server** of the smoke model: the bomb list, the constraints that cannot run and
   must be refused before admission (``MUST_REFUSE``: self-referencing schemas and grammars,
   grammars past llguidance's per-step limits, ``allowed_token_ids`` against a regex) plus
   generated schemas and regexes (``laneserve.bench.hostile``), four at a time, while an ordinary constrained request is sent
   every second and ``/health`` is polled every 100 ms from a process of its own (a load
   balancer's view: the benchmark's own sender threads share one interpreter lock and would add
   their waits to the figure). Reported: the slowest hostile answer
   (target <= 5 s), the slowest ordinary answer (<= 2 s), ``/health`` p99 and max (<= 0.5 s),
   restarts (0), the verdicts (every answer a 400 or a document satisfying its constraint) and
   each process's RSS growth (<= 200 MB).

    python benchmarks/structured_hostile.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from laneserve.bench.hostile import BOMB_REGEXES, BOMB_SCHEMAS, chat_body, judge, structured_cases
from laneserve.bench.live_server import Server, rss_mb
from laneserve.bench.results import markdown_table, write_result

MODEL = "smoke-llama"
LIMIT_S = 20.0
MEMORY_LIMIT = 4 << 30


def _engine_child(engine: str, kind: str, value, out) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    try:
        from laneserve.engine.structured.tiny_tokenizer import byte_level_tokenizer
        tok = byte_level_tokenizer(1024)
        t0 = time.perf_counter()
        if engine == "llguidance":
            from laneserve.core.structured import StructuredSpec
            from laneserve.engine.structured import compile_constraint
            spec = StructuredSpec.json_schema(value) if kind == "schema" else StructuredSpec.regex(value)
            state = compile_constraint(spec, tok).new_state()
            t1 = time.perf_counter()
            for _ in range(32):
                mask = state.allowed_mask(1024)
                allowed = [t for t in mask.nonzero().flatten().tolist() if t != tok.eos_token_id]
                if not allowed:
                    break
                state.advance(allowed[len(allowed) // 2])
        elif engine == "outlines-core":
            from outlines_core import Guide, Index, Vocabulary
            from outlines_core.json_schema import build_regex_from_schema
            from laneserve.engine.structured.vocab import token_vocabulary
            vocab = token_vocabulary(tok)
            by_bytes: dict[bytes, list[int]] = {}
            for tid, b in enumerate(vocab.token_bytes):
                if b and tid != tok.eos_token_id:
                    by_bytes.setdefault(b, []).append(tid)
            regex = build_regex_from_schema(json.dumps(value), "[ ]?") if kind == "schema" else value
            guide = Guide(Index(regex, Vocabulary(tok.eos_token_id, by_bytes)))
            t1 = time.perf_counter()
            for _ in range(32):
                allowed = [t for t in guide.get_tokens() if t != tok.eos_token_id]
                if not allowed:
                    break
                guide.advance(allowed[len(allowed) // 2])
        else:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=1024)
            compiler = xgr.GrammarCompiler(info)
            grammar = (compiler.compile_json_schema(json.dumps(value)) if kind == "schema"
                       else compiler.compile_regex(value))
            matcher = xgr.GrammarMatcher(grammar)
            t1 = time.perf_counter()
            import torch
            bitmask = xgr.allocate_token_bitmask(1, 1024)
            for _ in range(32):
                matcher.fill_next_token_bitmask(bitmask)
                logits = torch.zeros(1, 1024)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                allowed = [t for t in (logits[0] > -1).nonzero().flatten().tolist() if t != tok.eos_token_id]
                if not allowed:
                    break
                matcher.accept_token(allowed[len(allowed) // 2])
        out.put({"status": "ok", "compile_s": round(t1 - t0, 4), "masks_s": round(time.perf_counter() - t1, 4)})
    except MemoryError:
        out.put({"status": "out of memory"})
    except BaseException as exc:  # noqa: BLE001 - the engine's refusal is the result
        out.put({"status": "refused", "error": " ".join(str(exc).split())[:120]})


def engine_row(engine: str, kind: str, value) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_engine_child, args=(engine, kind, value, out))
    t0 = time.perf_counter()
    proc.start()
    proc.join(LIMIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": f"timeout (> {LIMIT_S:.0f} s)"}
    try:
        result = out.get(timeout=1)
    except Exception:  # noqa: BLE001 - the child died without a word (an abort past the memory limit)
        result = {"status": f"crashed (exit {proc.exitcode})"}
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def available_engines() -> list[str]:
    engines = ["llguidance"]
    for name, module in (("outlines-core", "outlines_core"), ("xgrammar", "xgrammar")):
        try:
            __import__(module)
            engines.append(name)
        except ImportError:
            pass
    return engines


def compare_engines() -> list[dict]:
    rows = []
    specs = [("schema", n, s) for n, s in BOMB_SCHEMAS] + [("regex", n, r) for n, r in BOMB_REGEXES]
    engines = available_engines()
    for kind, name, value in specs:
        row = {"spec": f"{kind}:{name}"}
        for engine in engines:
            r = engine_row(engine, kind, value)
            row[engine] = r["status"] if r["status"] != "ok" else f"{r['compile_s']:.3f} s + {r['masks_s']:.3f} s"
            print(f"  {kind}:{name} {engine}: {row[engine]}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def poll_health(url: str, stop, out) -> None:
    """Time ``GET /health`` every 100 ms on one kept-alive connection until ``stop``; send the
    latencies (ms; 5,000 for a failed poll) through ``out``."""
    times: list[float] = []
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                client.get(url + "/health")
                times.append((time.perf_counter() - t0) * 1e3)
            except httpx.HTTPError:
                times.append(5000.0)
            stop.wait(0.1)
    out.send(times)


def live() -> dict:
    server = Server("--prefill", "1", "--decode", "1")
    try:
        server.wait_ready()
        pids = {"api": server.proc.pid}
        for inst in server.state()["instances"]:
            pids[f"{inst['role']}-{inst['id']}"] = inst["pid"]
        # warm-up: one request of each kind, then the RSS baseline
        httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json=chat_body(MODEL, {"response_format": {"type": "json_object"}}, max_tokens=8))
        rss0 = {k: rss_mb(p) for k, p in pids.items()}
        stop = threading.Event()
        spawn = mp.get_context("spawn")
        health_stop, (health_out, health_in) = spawn.Event(), spawn.Pipe(False)
        poller = spawn.Process(target=poll_health, args=(server.url, health_stop, health_in), daemon=True)
        poller.start()
        ordinary_s: list[float] = []
        client = httpx.Client(timeout=60)     # one client (one TLS context) for every sender thread

        def ordinary():
            while not stop.is_set():
                t0 = time.perf_counter()
                r = client.post(server.url + "/v1/chat/completions", timeout=30, json=chat_body(
                    MODEL, {"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                            "required": ["ok"], "additionalProperties": False}}, max_tokens=16))
                ordinary_s.append(time.perf_counter() - t0 if r.status_code == 200 else 99.0)
                stop.wait(1.0)

        watchers = [threading.Thread(target=ordinary)]
        for w in watchers:
            w.start()
        cases = structured_cases(random.Random(11), generated=60)

        def send(case):
            name, path, fields = case
            t0 = time.perf_counter()
            r = client.post(server.url + path, json=chat_body(MODEL, fields, max_tokens=96, seed=len(name)))
            return name, fields, r.status_code, r.json(), time.perf_counter() - t0

        t_start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(send, cases))
        wall = time.perf_counter() - t_start
        stop.set()
        health_stop.set()
        for w in watchers:
            w.join()
        health_ms = health_out.recv()
        poller.join(timeout=30)
        client.close()
        health = httpx.get(server.url + "/health", timeout=5).json()
        time.sleep(2.0)
        rss1 = {k: rss_mb(p) for k, p in pids.items()}
        verdicts = [judge(fields, status, body) for _, fields, status, body, _ in results]
        latencies = [r[4] for r in results]
        hq = sorted(health_ms)
        return {
            "requests": len(results), "wall_s": round(wall, 1),
            "hostile_max_s": round(max(latencies), 2), "hostile_p50_s": round(statistics.median(latencies), 3),
            "ordinary_max_s": round(max(ordinary_s), 2), "ordinary_requests": len(ordinary_s),
            "health_p99_ms": round(hq[int(0.99 * (len(hq) - 1))], 1), "health_max_ms": round(hq[-1], 1),
            "restarts": sum(i["restarts"] for i in health["instances"]), "status": health["status"],
            "must_refuse_admitted": sum(1 for (name, *_), v in zip(results, verdicts)
                                        if name.startswith("refuse:") and v != "refused"),
            "refused": verdicts.count("refused"), "valid": verdicts.count("valid"), "cut": verdicts.count("cut"),
            "wrong": [v for v in verdicts if v.startswith("wrong")],
            "rss_growth_mb": {k: round(rss1[k] - rss0[k], 1) for k in pids if rss0[k] and rss1[k]},
            "slowest": sorted(((round(r[4], 2), r[0]) for r in results), reverse=True)[:5],
        }
    finally:
        server.stop()


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-engines", action="store_true",
                    help="only the live part; the engine table is kept from the committed result")
    args = ap.parse_args()
    if args.skip_engines:
        from pathlib import Path
        engines = json.loads((Path(__file__).parent / "results" / "structured_hostile.json").read_text())["engines"]
    else:
        print("engines on the bomb list ...", file=sys.stderr)
        engines = compare_engines()
    print("live server ...", file=sys.stderr)
    run = live()
    growth = max(run["rss_growth_mb"].values())
    metrics = {"hostile_max_s": run["hostile_max_s"], "ordinary_max_s": run["ordinary_max_s"],
               "health_p99_ms": run["health_p99_ms"], "health_max_ms": run["health_max_ms"],
               "restarts": run["restarts"], "wrong_documents": len(run["wrong"]), "refused": run["refused"],
               "valid": run["valid"], "cut_at_max_tokens": run["cut"], "max_rss_growth_mb": growth,
               "must_refuse_admitted": run["must_refuse_admitted"],
               "targets_met": bool(run["hostile_max_s"] <= 5 and run["ordinary_max_s"] <= 2
                                   and run["health_max_ms"] <= 500 and run["restarts"] == 0
                                   and not run["wrong"] and growth <= 200 and run["must_refuse_admitted"] == 0)}
    md = ["## Engines on the bomb list (compile/check + 32 masks, 1,024-token vocabulary)", "",
          markdown_table(engines), "",
          "## Live 1P+1D server, the bombs plus 60 generated schemas and regexes, 4 at a time", "",
          markdown_table([{"metric": k, "value": v} for k, v in run.items() if k not in ("wrong", "slowest")]), "",
          f"Slowest hostile answers: {run['slowest']}", ""]
    write_result("structured_hostile", metrics, extra={"engines": engines, "live": run},
                 command="python benchmarks/structured_hostile.py", markdown="\n".join(md))
    print(json.dumps(metrics, indent=1))
    return 0 if metrics["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
