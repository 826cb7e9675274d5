"""A rank of a live ``laneserve serve --colocated -tp 2`` instance killed mid-prefill and mid-decode:
the request it served fails cleanly (an error event naming the lost rank, then ``[DONE]``), the
instance goes down as a whole and is restarted (a new group), the server answers the next request
as before, and nothing of the old group is left: no process it started, no shared-memory file.
One server for the module: each kill is one more restart of the same instance."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from laneserve.core.sampling import SamplingParams
from laneserve.engine.llm import LLM
from server_support import TIMEOUT, Server, wait_for

PROMPT = "The quick brown fox"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (its ranks and their helpers)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def _group_files(pid: int) -> set[str]:
    """The shared-memory files of the group whose rank 0 is ``pid`` (named after it)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith((f"laneserve-tp-{pid}-", f"laneserve-stop-{pid}-"))}


def _semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}


@pytest.fixture(scope="module")
def server():
    ref = LLM(quiet=True).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    srv = Server("--colocated", "-tp", "2")
    try:
        srv.wait_ready()
        srv.ref = ref.text
        yield srv
    finally:
        srv.stop()


def _instance(srv: Server) -> dict:
    return srv.state()["instances"][0]


def _stream(srv: Server, max_tokens: int, out: list, started: threading.Event) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def _kill_rank_and_check_recovery(srv: Server, before: dict, read: threading.Thread, out: list) -> None:
    """SIGKILL ``before``'s rank 1; the stream ``read`` fills ``out`` must end in an error naming the
    rank; the instance comes back with a new group and nothing of the old one is left."""
    rank = before["rank_pids"][0]
    spawned, sems = _children(before["pid"]), _semaphores()
    assert rank in spawned, spawned
    os.kill(rank, signal.SIGKILL)
    read.join(TIMEOUT)
    assert not read.is_alive(), "the stream did not end"
    assert out[0] == 200 and out[-1] == "data: [DONE]", out[-3:]
    errors = [json.loads(ln[6:])["error"]["message"] for ln in out[1:] if ln.startswith("data: {") and '"error"' in ln]
    assert len(errors) == 1 and f"rank 1 (pid {rank}) exited" in errors[0], out[-3:]
    after = wait_for(lambda: (i := _instance(srv))["status"] == "ready" and i["restarts"] == before["restarts"] + 1
                     and i, 120, "the instance to be restarted")
    assert after["pid"] != before["pid"] and after["rank_pids"][0] != rank and _alive(after["rank_pids"][0])
    wait_for(lambda: not any(_alive(p) for p in spawned | {before["pid"]}), 20, "the old group's processes to exit")
    assert not _group_files(before["pid"])
    # the old group's step channel had two named semaphores (others' files may come and go alongside)
    wait_for(lambda: len(sems - _semaphores()) >= 2, 20, "the old group's semaphores to be removed")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.ref, r.text
    assert srv.state()["in_flight"] == 0


def test_a_rank_killed_mid_decode_restarts_the_instance_and_leaves_nothing(server):
    before = _instance(server)
    out: list = []
    started = threading.Event()
    read = threading.Thread(target=_stream, args=(server, 4000, out, started), daemon=True)
    read.start()
    assert started.wait(TIMEOUT), "no token streamed"
    _kill_rank_and_check_recovery(server, before, read, out)


def test_a_rank_killed_mid_prefill_restarts_the_instance_and_leaves_nothing(server):
    """Rank 1 is stopped first, so the prefill step waits for it inside the forward's first
    all-reduce; then it is killed there."""
    before = _instance(server)
    os.kill(before["rank_pids"][0], signal.SIGSTOP)
    out: list = []
    started = threading.Event()
    read = threading.Thread(target=_stream, args=(server, 8, out, started), daemon=True)
    read.start()
    wait_for(lambda: server.state()["in_flight"] == 1, 10, "the request to reach the instance")
    assert not started.wait(0.5), "a token came out of a group whose rank 1 is stopped"
    _kill_rank_and_check_recovery(server, before, read, out)


def test_a_rank_killed_while_idle_takes_the_instance_down_and_it_comes_back(server):
    """No step is running: rank 0 still notices (it looks at its ranks between steps) and the group
    is restarted before any request needs it."""
    before = _instance(server)
    rank = before["rank_pids"][0]
    spawned = _children(before["pid"])
    os.kill(rank, signal.SIGKILL)
    after = wait_for(lambda: (i := _instance(server))["status"] == "ready" and i["restarts"] == before["restarts"] + 1
                     and i, 120, "the instance to be restarted")
    assert after["pid"] != before["pid"]
    wait_for(lambda: not any(_alive(p) for p in spawned | {before["pid"]}), 20, "the old group's processes to exit")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.ref, r.text


def test_a_rank_failing_at_start_up_fails_the_server_start_in_one_line(tmp_path):
    """Rank 1 exits as the group starts (its entry point swapped in by a ``sitecustomize`` every
    process of the server imports): the server exits 2 with one error line naming the rank and
    its exit code, and that rank is gone."""
    import re
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text(
        "import laneserve.engine.tp.executor as _ex\nimport tp_fault_support as _f\n"
        "_ex.rank_main = _f.exits_before_join\n")
    here = str(Path(__file__).parent)
    srv = Server("--colocated", "-tp", "2",
                 env={"PYTHONPATH": os.pathsep.join([str(tmp_path), here, os.environ.get("PYTHONPATH", "")])})
    try:
        assert srv.proc.wait(timeout=120) == 2
        errors = [ln for ln in srv.proc.stderr.read().splitlines() if ln.startswith("laneserve: error:")]
    finally:
        srv.stop()
    assert len(errors) == 1, errors
    found = re.search(r"failed to start: RankLost: tensor-parallel group failed to start: "
                      r"rank 1 \(pid (\d+)\) exited with code 3$", errors[0])
    assert found, errors
    assert not _alive(int(found.group(1)))
