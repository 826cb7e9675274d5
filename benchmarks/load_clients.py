"""Third-party load clients against ``laneserve serve``: do they still run clean?

Starts ``laneserve serve`` with the embedded smoke model on 127.0.0.1 (1 prefill + 1 decode
instance), then runs each client, one after the other, against it with a small bounded load:

- **guidellm 0.8.1**: ``guidellm run`` with the ``openai_http`` backend (streamed
  ``/v1/chat/completions``, its default), a ``constant`` profile at ``RATE`` requests/s stopped
  after ``REQUESTS`` requests (or ``MAX_SECONDS``), synthetic text of ``PROMPT_TOKENS`` prompt /
  ``OUTPUT_TOKENS`` output tokens made with the smoke model's own tokenizer (its folder).
- **inference-perf 0.7.0**: a YAML config with streamed ``completion`` requests, a ``concurrent``
  load of ``CONCURRENCY`` streams for ``REQUESTS`` requests, ``synthetic`` data of about
  ``PROMPT_TOKENS`` / exactly ``OUTPUT_TOKENS`` tokens (``ignore_eos``), the same tokenizer.

So one client drives a fixed rate on the chat endpoint and the other a fixed concurrency on the
completions endpoint. Each client runs under a subprocess timeout (``RUN_TIMEOUT_S``, its whole
process group killed past it). Reported per client: requests sent, completed, errored (with the
error messages), the client's own TTFT / ITL / throughput numbers (read from its JSON report, and
its printed tables quoted in the markdown), the server's own count of finished / refused /
aborted requests over the run (from ``/metrics``), whether every instance was at rest with all KV
blocks free afterwards, and ``clean`` = the client exited 0, completed at least one request, and
had zero errored and zero incomplete requests.

The clients have heavy dependencies and never go into the project's venv: each gets its own
virtual environment under ``$LANESERVE_LOAD_CLIENTS_DIR`` (default
``~/.cache/laneserve/load-clients/<name>``), built on first use and reused after.

- guidellm requires an unpinned ``torch``; its venv gets ``torch==2.13.0+cpu`` first (the local
  CPU wheel; pinning the ``+cpu`` build means an install can never fall back to the multi-GB CUDA
  wheels), then ``guidellm==0.8.1`` under a constraint that keeps that torch; the install is
  checked (``torch.__version__``) before use.
- inference-perf 0.7.0's wheel declares ``Requires-Python >=3.12`` (so ``pip`` under the
  project's Python 3.11 finds no version of it); its venv is built with the first Python >= 3.12
  found on the machine (``python3.12``/``python3.13``/``python3.14`` on PATH, pyenv versions).
  When there is none, or an install fails, the client is reported as not run, with the reason.

Exit status 0 when every client that could run was clean. Writes
``benchmarks/results/load_clients.{json,md}``.

    nice -n 10 flock /tmp/laneserve-bench.lock python benchmarks/load_clients.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from laneserve.bench.live_server import Server, wait_all_free
from laneserve.bench.results import markdown_table, write_result
from laneserve.engine.smoke import smoke_model_path

MODEL = "smoke-llama"                     # the name `laneserve serve` serves the smoke model under
REQUESTS = 32
RATE = 4.0                                # guidellm: requests per second
CONCURRENCY = 4                           # inference-perf: concurrent streams
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 16     # far inside the smoke model's 4,096-token context
MAX_SECONDS = 60                          # guidellm stops its benchmark after this, whatever the count
REQUEST_TIMEOUT_S = 30
RUN_TIMEOUT_S = 170                       # a whole client run, start-up included
INSTALL_TIMEOUT_S = 1200

GUIDELLM_VERSION = "0.8.1"
TORCH_PIN = "2.13.0+cpu"
INFERENCE_PERF_VERSION = "0.7.0"
INFERENCE_PERF_MIN_PYTHON = (3, 12)       # Requires-Python of the inference-perf 0.7.0 wheel

# no client may reach outside this machine: tokenizers and data come from local files
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "NO_PROXY": "127.0.0.1,localhost",
               "no_proxy": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1", "COLUMNS": "160",
               "GUIDELLM__MAX_WORKER_PROCESSES": "2"}   # 2 cores here: not guidellm's default 10


def log(msg: str) -> None:
    print(f"[load_clients] {msg}", file=sys.stderr, flush=True)


def cache_root(arg: str | None) -> Path:
    root = arg or os.environ.get("LANESERVE_LOAD_CLIENTS_DIR") or "~/.cache/laneserve/load-clients"
    return Path(root).expanduser()


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OFFLINE_ENV)
    return env


def run_cmd(cmd: list[str], timeout: float, cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` in its own process group; past ``timeout`` the whole group is ended
    (SIGTERM, then SIGKILL). Returns rc, combined output, wall seconds and ``timed_out``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env if env is not None else client_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            errors="replace")
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                out = ""
    return {"rc": proc.returncode, "output": out or "", "wall_s": time.monotonic() - t0, "timed_out": timed_out}


def tail(text: str, n: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def python_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys, venv; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


# ---------------------------------------------------------------------------------------------
# virtual environments


def make_venv(path: Path, python: str) -> dict:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    r = run_cmd([python, "-m", "venv", str(path)], timeout=300)
    if r["rc"] != 0:
        return {"ok": False, "reason": f"`{python} -m venv {path}` failed: {tail(r['output'], 600)}"}
    return {"ok": True}


def pip_install(venv: Path, *args: str) -> dict:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *args]
    log("  " + " ".join(cmd[1:]))
    r = run_cmd(cmd, timeout=INSTALL_TIMEOUT_S)
    if r["rc"] != 0 or r["timed_out"]:
        return {"ok": False, "reason": f"`pip install {' '.join(args)}` failed (rc={r['rc']}, "
                                       f"timed_out={r['timed_out']}): {tail(r['output'], 1200)}"}
    return {"ok": True}


def venv_probe(venv: Path, code: str) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                             env=client_env())
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


GUIDELLM_PROBE = ("import importlib.metadata as m, sys, torch; "
                  "print(m.version('guidellm'), torch.__version__, '%d.%d.%d' % sys.version_info[:3])")


def ensure_guidellm(root: Path) -> dict:
    venv = root / "guidellm"
    found = venv_probe(venv, GUIDELLM_PROBE)
    if found and found.split()[:2] == [GUIDELLM_VERSION, TORCH_PIN]:
        version, torch_v, py = found.split()
        return {"ok": True, "venv": str(venv), "version": version, "torch": torch_v, "python": py,
                "installed_now": False}
    log(f"building guidellm {GUIDELLM_VERSION} venv at {venv} (found: {found!r})")
    # torch's local CPU wheel is built for the project's own Python (3.11): use the same one
    made = make_venv(venv, getattr(sys, "_base_executable", None) or sys.executable)
    if not made["ok"]:
        return made | {"venv": str(venv)}
    pin = venv / "torch-pin.txt"
    pin.write_text(f"torch=={TORCH_PIN}\n")
    for args in ([f"torch=={TORCH_PIN}"], ["-c", str(pin), f"guidellm=={GUIDELLM_VERSION}"]):
        step = pip_install(venv, *args)
        if not step["ok"]:
            return step | {"venv": str(venv)}
    found = venv_probe(venv, GUIDELLM_PROBE)
    if not found or found.split()[:2] != [GUIDELLM_VERSION, TORCH_PIN]:
        return {"ok": False, "venv": str(venv),
                "reason": f"after install, guidellm / torch versions are {found!r}, "
                          f"not {GUIDELLM_VERSION} / {TORCH_PIN}"}
    version, torch_v, py = found.split()
    return {"ok": True, "venv": str(venv), "version": version, "torch": torch_v, "python": py,
            "installed_now": True}


def find_python(minimum: tuple[int, int]) -> tuple[str | None, list[str]]:
    """The first Python >= ``minimum`` with ``venv`` on this machine, and what was looked at."""
    candidates: list[str] = []
    for name in ("python3.12", "python3.13", "python3.14"):
        if (p := shutil.which(name)):
            candidates.append(p)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    for p in sorted((pyenv_root / "versions").glob("3.*/bin/python3")):
        candidates.append(str(p))
    candidates += [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists()]
    seen = []
    for c in candidates:
        v = python_version(c)
        seen.append(f"{c} ({'%d.%d' % v if v else 'unusable'})")
        if v is not None and v >= minimum:
            return c, seen
    return None, seen


IP_PROBE = "import importlib.metadata as m, sys; print(m.version('inference-perf'), '%d.%d.%d' % sys.version_info[:3])"


def ensure_inference_perf(root: Path) -> dict:
    venv = root / "inference-perf"
    found = venv_probe(venv, IP_PROBE)
    if found and found.split()[0] == INFERENCE_PERF_VERSION:
        version, py = found.split()
        return {"ok": True, "venv": str(venv), "version": version, "python": py, "installed_now": False}
    python, looked = find_python(INFERENCE_PERF_MIN_PYTHON)
    if python is None:
        return {"ok": False, "venv": str(venv),
                "reason": f"inference-perf {INFERENCE_PERF_VERSION} requires Python >= "
                          f"{'%d.%d' % INFERENCE_PERF_MIN_PYTHON} (its wheel's Requires-Python), and no such "
                          f"Python is on this machine (looked at: {', '.join(looked) or 'nothing found'})"}
    log(f"building inference-perf {INFERENCE_PERF_VERSION} venv at {venv} with {python}")
    made = make_venv(venv, python)
    if not made["ok"]:
        return made | {"venv": str(venv)}
    step = pip_install(venv, f"inference-perf=={INFERENCE_PERF_VERSION}")
    if not step["ok"]:
        return step | {"venv": str(venv)}
    found = venv_probe(venv, IP_PROBE)
    if not found or found.split()[0] != INFERENCE_PERF_VERSION:
        return {"ok": False, "venv": str(venv), "reason": f"after install, inference-perf version is {found!r}"}
    version, py = found.split()
    return {"ok": True, "venv": str(venv), "version": version, "python": py, "installed_now": True}


# ---------------------------------------------------------------------------------------------
# the server's own view


def server_counters(url: str) -> dict[str, float]:
    """Finished / refused / aborted request counters summed over labels (the ``laneserve:``
    names; empty when the exposition cannot be read)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {"laneserve:request_success_total": "finished", "laneserve:request_rejected_total": "rejected",
              "laneserve:request_aborted_total": "aborted"}
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
        if "laneserve:request_success" in text:   # read: a labelled counter with no sample yet is 0
            out = dict.fromkeys(wanted.values(), 0.0)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in wanted:
                    out[wanted[s.name]] = out.get(wanted[s.name], 0.0) + s.value
    except Exception as exc:  # noqa: BLE001 - a missing exposition only loses the cross-check
        log(f"could not read /metrics: {exc}")
    return out


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int | None]:
    return {f"server_{k}": (int(after[k] - before.get(k, 0.0)) if k in after else None)
            for k in ("finished", "rejected", "aborted")}


def at_rest(server: Server) -> bool:
    try:
        wait_all_free(server, timeout=30)
        return True
    except Exception as exc:  # noqa: BLE001
        log(f"server not at rest after the run: {exc}")
        return False


# ---------------------------------------------------------------------------------------------
# client output


def section(text: str, title: str) -> str | None:
    """The printed table under the first line that contains ``title``: up to a blank line or
    the end of a box-drawn table."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if title in line:
            block = [line]
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    break
                block.append(nxt)
                if nxt.lstrip().startswith("└"):
                    break
            return "\n".join(block)
    return None


def _stat_ms(stat: dict | None, scale: float = 1.0) -> dict[str, float | None]:
    if not stat:
        return {"mean": None, "median": None, "p95": None}
    pct = stat.get("percentiles") or {}
    p95 = pct.get("p95", stat.get("p95"))
    return {"mean": None if stat.get("mean") is None else stat["mean"] * scale,
            "median": None if stat.get("median") is None else stat["median"] * scale,
            "p95": None if p95 is None else p95 * scale}


# ---------------------------------------------------------------------------------------------
# guidellm


def run_guidellm(info: dict, server: Server, work: Path, requests: int, rate: float) -> dict:
    report = work / "guidellm.json"
    exe = str(Path(info["venv"]) / "bin" / "guidellm")
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={server.url},model={MODEL},timeout={REQUEST_TIMEOUT_S}",
           "--profile", f"kind=constant,rate={rate:g}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--constraint", f"kind=max_duration,seconds={MAX_SECONDS}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={smoke_model_path()}",
           "--output", f"kind=json,path={report}",
           "--disable-progress"]
    log("guidellm: " + " ".join(cmd))
    r = run_cmd(cmd, timeout=RUN_TIMEOUT_S, cwd=work)
    row = {"client": "guidellm", "version": info["version"], "python": info["python"], "torch": info["torch"],
           "load": f"constant {rate:g} req/s, max {requests} requests / {MAX_SECONDS} s, "
                   f"streamed /v1/chat/completions, synthetic {PROMPT_TOKENS}/{OUTPUT_TOKENS} tokens",
           "command": " ".join(cmd), "rc": r["rc"], "timed_out": r["timed_out"], "wall_s": r["wall_s"]}
    errors: list[str] = []
    if not report.is_file():
        errors.append(f"guidellm wrote no report (rc={r['rc']}, timed_out={r['timed_out']}): {tail(r['output'])}")
        return row | {"sent": 0, "completed": 0, "errored": None, "incomplete": None, "errors": errors,
                      "client_tables": None}
    data = json.loads(report.read_text())
    bench = data["benchmarks"][0]
    reqs = bench.get("requests", {})
    errored_list = reqs.get("errored") or []
    incomplete_list = reqs.get("incomplete") or []
    for item in errored_list + incomplete_list:
        msg = (item.get("info") or {}).get("error") or (item.get("info") or {}).get("status") or "no message"
        errors.append(str(msg))
    totals = bench["metrics"]["request_totals"]
    m = bench["metrics"]

    def ok(name: str) -> dict | None:
        return (m.get(name) or {}).get("successful")

    row |= {"sent": totals["successful"] + totals["errored"] + totals["incomplete"],
            "completed": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "errors": [f"{n} x {msg}" for msg, n in Counter(errors).most_common()],
            "ttft_ms": _stat_ms(ok("time_to_first_token_ms")),
            "itl_ms": _stat_ms(ok("inter_token_latency_ms")),
            "tpot_ms": _stat_ms(ok("time_per_output_token_ms")),
            "request_latency_s": _stat_ms(ok("request_latency")),
            "requests_per_s": (ok("requests_per_second") or {}).get("mean"),
            "output_tokens_per_s": (ok("output_tokens_per_second") or {}).get("mean"),
            "duration_s": bench.get("duration"),
            "client_warnings": [" ".join(str(w.get(k)) for k in ("message", "note") if w.get(k))
                                if isinstance(w, dict) else str(w) for w in bench.get("warnings") or []],
            "client_tables": "\n\n".join(t for t in (section(r["output"], "Request Latency Statistics"),
                                                     section(r["output"], "Server Throughput Statistics")) if t)
            or None}
    if r["rc"] != 0 or r["timed_out"]:
        row["errors"].append(f"guidellm exited rc={r['rc']} timed_out={r['timed_out']}: {tail(r['output'], 600)}")
    return row


# ---------------------------------------------------------------------------------------------
# inference-perf


def inference_perf_config(url: str, reports: Path, requests: int, concurrency: int) -> str:
    """The YAML config (written by hand: the clients' venvs are separate, the project's has PyYAML
    only by chance, and the shape is small)."""
    tok = smoke_model_path()
    return f"""\
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: {MODEL}
  base_url: {url}
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: {tok}
data:
  type: synthetic
  input_distribution: {{min: {PROMPT_TOKENS * 3 // 4}, max: {PROMPT_TOKENS * 5 // 4}, mean: {PROMPT_TOKENS}, std_dev: 8, total_count: {requests}}}
  output_distribution: {{min: {OUTPUT_TOKENS}, max: {OUTPUT_TOKENS}, mean: {OUTPUT_TOKENS}, std_dev: 0, total_count: {requests}}}
load:
  type: concurrent
  stages:
  - concurrency_level: {concurrency}
    num_requests: {requests}
  num_workers: 1
  request_timeout: {REQUEST_TIMEOUT_S}
report:
  request_lifecycle:
    summary: true
    per_stage: true
    per_request: true
storage:
  local_storage:
    path: {reports}
"""


def run_inference_perf(info: dict, server: Server, work: Path, requests: int, concurrency: int) -> dict:
    reports = work / "inference-perf-reports"
    cfg = work / "inference-perf.yml"
    cfg.write_text(inference_perf_config(server.url, reports, requests, concurrency))
    exe = str(Path(info["venv"]) / "bin" / "inference-perf")
    cmd = [exe, "--config_file", str(cfg)]
    log("inference-perf: " + " ".join(cmd))
    r = run_cmd(cmd, timeout=RUN_TIMEOUT_S, cwd=work)
    row = {"client": "inference-perf", "version": info["version"], "python": info["python"], "torch": None,
           "load": f"concurrent {concurrency} streams, {requests} requests, streamed /v1/completions, "
                   f"synthetic ~{PROMPT_TOKENS}/{OUTPUT_TOKENS} tokens, ignore_eos",
           "command": " ".join(cmd), "config": cfg.read_text(), "rc": r["rc"], "timed_out": r["timed_out"],
           "wall_s": r["wall_s"]}
    summary_file = reports / "summary_lifecycle_metrics.json"
    errors: list[str] = []
    if not summary_file.is_file():
        errors.append(f"inference-perf wrote no summary (rc={r['rc']}, timed_out={r['timed_out']}): "
                      f"{tail(r['output'])}")
        return row | {"sent": 0, "completed": 0, "errored": None, "incomplete": None, "errors": errors,
                      "client_tables": None}
    s = json.loads(summary_file.read_text())
    succ, fail = s.get("successes") or {}, s.get("failures") or {}
    for label, detail in (fail.get("by_label") or {}).items():     # {label: {count, messages: [{message}]}}
        if not isinstance(detail, dict):
            errors.append(f"{label}: {json.dumps(detail)[:500]}")
            continue
        msgs = [str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in detail.get("messages") or []]
        errors.append(f"{detail.get('count', '?')} x {label}" + (f": {' | '.join(msgs)[:500]}" if msgs else ""))
    lat = succ.get("latency") or {}
    thr = succ.get("throughput") or {}
    validation = {}
    if (reports / "validation.json").is_file():
        v = json.loads((reports / "validation.json").read_text())
        validation = {"errors": v.get("global", {}).get("errors", []) + [e for rep in v.get("reports", {}).values()
                                                                       for e in rep.get("errors", [])],
                      "warnings": sorted({w.get("message", str(w)) for rep in v.get("reports", {}).values()
                                          for w in rep.get("warnings", [])})}
    completed, failed = int(succ.get("count") or 0), int(fail.get("count") or 0)
    sent = int((s.get("load_summary") or {}).get("count") or completed + failed)
    row |= {"sent": sent, "completed": completed, "errored": failed, "incomplete": max(sent - completed - failed, 0),
            "errors": errors,
            "ttft_ms": _stat_ms(lat.get("time_to_first_token"), 1e3),
            "itl_ms": _stat_ms(lat.get("inter_token_latency"), 1e3),
            "tpot_ms": _stat_ms(lat.get("time_per_output_token"), 1e3),
            "request_latency_s": _stat_ms(lat.get("request_latency")),
            "requests_per_s": thr.get("requests_per_sec"),
            "output_tokens_per_s": thr.get("output_tokens_per_sec"),
            "duration_s": s.get("benchmark_time_seconds"),
            "client_warnings": validation.get("warnings", []),
            "client_report_errors": validation.get("errors", []),
            "client_tables": "\n".join(t for t in (section(r["output"], "Throughput and Goodput Summary"),
                                                   section(r["output"], "Request & Token Latency (ms)"),
                                                   section(r["output"], "Request Error Summary")) if t) or None}
    if r["rc"] != 0 or r["timed_out"]:
        row["errors"].append(f"inference-perf exited rc={r['rc']} timed_out={r['timed_out']}: "
                             f"{tail(r['output'], 600)}")
    return row


# ---------------------------------------------------------------------------------------------


def is_clean(row: dict) -> bool:
    return (row["rc"] == 0 and not row["timed_out"] and row["completed"] > 0 and row["errored"] == 0
            and row["incomplete"] == 0 and not row["errors"])


NOTES = """## How to read this

- One `laneserve serve` (smoke model: 2-layer random Llama, 4,096-token context, CPU, 1 prefill +
  1 decode instance) on 127.0.0.1; the clients run one after the other against it, each in its
  own virtual environment, each under a subprocess timeout.
- `sent` / `completed` / `errored` / `incomplete` are the client's own counts (guidellm's
  `request_totals`, inference-perf's `load_summary` / `successes` / `failures`);
  `server_finished` / `server_rejected` / `server_aborted` are the server's `/metrics` counters
  over the same run; `at_rest_after` = every instance idle with all KV blocks free within 30 s.
- `clean` = the client exited 0, completed at least one request, and counted zero errored and
  zero incomplete requests.
- guidellm's `req/s` is its own open-loop target rate being met; inference-perf's is what its
  closed-loop streams got through (its stage lasts about a second).
- TTFT / ITL / TPOT are the clients' own figures (median / p95 over completed requests) on a
  shared 2-core machine with a random-weight model: they show the path works, not how fast a
  real deployment is. The smoke model's text is noise, so a client that re-tokenizes the output
  counts a different number of tokens than the server reports (inference-perf warns
  `token_mismatches`); the server's count is the exact `max_tokens`.
"""


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="guidellm,inference-perf",
                    help="comma-separated: guidellm, inference-perf (default: both)")
    ap.add_argument("--requests", type=int, default=REQUESTS, help=f"requests per client (default {REQUESTS})")
    ap.add_argument("--rate", type=float, default=RATE, help=f"guidellm constant rate, req/s (default {RATE:g})")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY,
                    help=f"inference-perf concurrent streams (default {CONCURRENCY})")
    ap.add_argument("--cache-dir", default=None, help="where the clients' venvs live (default "
                    "$LANESERVE_LOAD_CLIENTS_DIR or ~/.cache/laneserve/load-clients)")
    ap.add_argument("--results-dir", default=None, help="default benchmarks/results")
    args = ap.parse_args()
    if not 0 < args.requests <= 200 or not 0 < args.rate <= 50 or not 0 < args.concurrency <= 32:
        ap.error("keep the load bounded: --requests 1..200, --rate up to 50, --concurrency 1..32")
    wanted = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = set(wanted) - {"guidellm", "inference-perf"}
    if unknown:
        ap.error(f"unknown client(s): {', '.join(sorted(unknown))}")
    root = cache_root(args.cache_dir)
    smoke_model_path()                     # built once here, before any client needs its tokenizer

    setups: dict[str, dict] = {}
    for name in wanted:
        log(f"setting up {name}")
        setups[name] = ensure_guidellm(root) if name == "guidellm" else ensure_inference_perf(root)
        log(f"  {name}: {'ready' if setups[name]['ok'] else 'NOT RUN: ' + setups[name]['reason']}")

    rows: list[dict] = []
    not_run = [{"client": n, "reason": s["reason"], "venv": s.get("venv")} for n, s in setups.items() if not s["ok"]]
    runnable = [n for n in wanted if setups[n]["ok"]]
    server_stderr = ""
    if runnable:
        server = Server("--host", "127.0.0.1", "--prefill", "1", "--decode", "1")
        try:
            server.wait_ready()
            with tempfile.TemporaryDirectory(prefix="laneserve-load-clients-") as tmp:
                for name in runnable:
                    work = Path(tmp) / name
                    work.mkdir()
                    before = server_counters(server.url)
                    if name == "guidellm":
                        row = run_guidellm(setups[name], server, work, args.requests, args.rate)
                    else:
                        row = run_inference_perf(setups[name], server, work, args.requests, args.concurrency)
                    row["at_rest_after"] = at_rest(server)
                    row |= server_delta(before, server_counters(server.url))
                    row["clean"] = is_clean(row)
                    row["installed_now"] = setups[name]["installed_now"]
                    row["venv"] = setups[name]["venv"]
                    log(f"{name}: sent={row['sent']} completed={row['completed']} errored={row['errored']} "
                        f"incomplete={row['incomplete']} clean={row['clean']} ({row['wall_s']:.0f} s)")
                    rows.append(row)
        finally:
            server.stop()
            if server.proc.stderr is not None:
                try:
                    server_stderr = tail(server.proc.stderr.read(), 2000)
                except (OSError, ValueError):
                    pass

    all_clean = all(r["clean"] for r in rows)
    metrics: dict = {"clients_run": len(rows), "clients_clean": sum(r["clean"] for r in rows),
                     "clients_not_run": len(not_run), "all_run_clean": all_clean}
    for r in rows:
        key = r["client"].replace("-", "_")
        metrics |= {f"{key}_version": r["version"], f"{key}_sent": r["sent"], f"{key}_completed": r["completed"],
                    f"{key}_errored": r["errored"], f"{key}_clean": r["clean"]}
    for n in not_run:
        metrics[f"{n['client'].replace('-', '_')}_not_run"] = n["reason"]

    table = [{"client": r["client"], "version": r["version"], "load": r["load"], "sent": r["sent"],
              "completed": r["completed"], "errored": r["errored"], "incomplete": r["incomplete"],
              "server finished / rejected / aborted": " / ".join(
                  "-" if r.get(k) is None else str(r[k]) for k in ("server_finished", "server_rejected", "server_aborted")),
              "at rest after": r["at_rest_after"],
              "clean": r["clean"]} for r in rows]
    perf = [{"client": r["client"],
             "TTFT ms p50 / p95": f"{fmt((r.get('ttft_ms') or {}).get('median'))} / {fmt((r.get('ttft_ms') or {}).get('p95'))}",
             "ITL ms p50 / p95": f"{fmt((r.get('itl_ms') or {}).get('median'))} / {fmt((r.get('itl_ms') or {}).get('p95'))}",
             "TPOT ms p50": fmt((r.get('tpot_ms') or {}).get('median')),
             "req/s": fmt(r.get("requests_per_s"), ".2f"), "output tok/s": fmt(r.get("output_tokens_per_s")),
             "wall s": fmt(r["wall_s"], ".0f")} for r in rows]
    md = ["## Per client\n", markdown_table(table) if rows else "(no client ran)\n",
          "\n## The clients' own latency and throughput\n", markdown_table(perf) if rows else "(none)\n"]
    for r in rows:
        md.append(f"\n### {r['client']} {r['version']} (Python {r['python']}"
                  + (f", torch {r['torch']}" if r.get("torch") else "") + ")\n")
        md.append(f"Command: `{r['command']}`\n")
        if r["client"] == "inference-perf":
            md.append(f"\nThe inference-perf {r['version']} wheel declares `Requires-Python >="
                      f"{'%d.%d' % INFERENCE_PERF_MIN_PYTHON}`, so `pip` under "
                      f"the project's Python {sys.version_info[0]}.{sys.version_info[1]} finds no version of it; its "
                      f"venv is built on the Python {r['python']} found on this machine.\n")
        if r["errors"]:
            md.append("\nErrors:\n\n" + "\n".join(f"- `{e}`" for e in r["errors"]) + "\n")
        if r.get("client_warnings"):
            md.append("\nThe client's own warnings:\n\n" + "\n".join(f"- {w}" for w in r["client_warnings"]) + "\n")
        if r.get("client_tables"):
            md.append("\nAs the client printed it:\n\n```\n" + r["client_tables"] + "\n```\n")
    if not_run:
        md.append("\n## Not run\n\n" + "\n".join(f"- **{n['client']}**: {n['reason']}" for n in not_run) + "\n")
    md.append("\n" + NOTES)
    extra = {"clients": rows, "not_run": not_run,
             "settings": {"requests": args.requests, "guidellm_rate": args.rate,
                          "inference_perf_concurrency": args.concurrency, "prompt_tokens": PROMPT_TOKENS,
                          "output_tokens": OUTPUT_TOKENS, "run_timeout_s": RUN_TIMEOUT_S,
                          "request_timeout_s": REQUEST_TIMEOUT_S, "server": "laneserve serve --host 127.0.0.1 "
                          "--prefill 1 --decode 1 (smoke model)"},
             "server_stderr_tail": server_stderr}
    path = write_result("load_clients", metrics, markdown="".join(md), extra=extra, results_dir=args.results_dir)
    print(path)
    for r in rows:
        print(f"{r['client']} {r['version']}: sent {r['sent']}, completed {r['completed']}, errored {r['errored']}, "
              f"incomplete {r['incomplete']}, clean={r['clean']}" + (f"; errors: {r['errors']}" if r["errors"] else ""))
    for n in not_run:
        print(f"{n['client']}: NOT RUN: {n['reason']}")
    return 0 if all_clean else 1


if __name__ == "__main__":
    sys.exit(main())
