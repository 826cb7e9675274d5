"""A live ``laneserve serve`` in a subprocess on 127.0.0.1, for tests and benchmarks: bounded
start-up and shutdown, the ``/debug/state`` snapshot, an ``openai`` client, and bounded waits
(for every instance to be at rest, or for any condition) that fail when the wait runs out."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

TIMEOUT = 30.0


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``laneserve serve ARGS`` in a subprocess; ``stop()`` ends it (SIGINT, then SIGKILL)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.proc = subprocess.Popen([sys.executable, "-m", "laneserve.cli", "serve", "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 150.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def state(self) -> dict:
        return httpx.get(self.url + "/debug/state", headers=self.headers, timeout=5).json()

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=TIMEOUT)

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@contextlib.contextmanager
def serving(*args: str, **kwargs):
    """``laneserve serve ARGS`` started, healthy, and stopped on leaving the block (whatever happens)."""
    server = Server(*args, **kwargs)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def wait_all_free(server: Server, timeout: float = 15.0) -> dict:
    """Poll until nothing is in flight and every live instance holds no request and all its KV
    blocks are free; fail (AssertionError) if that does not happen within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        st = server.state()
        insts = [i for i in st["instances"] if i["alive"]]
        if st["in_flight"] == 0 and all(i["kv_free_blocks"] == i["kv_total_blocks"] and i["live_requests"] == 0
                                        for i in insts):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"KV not freed: {st}")
        time.sleep(0.05)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate()`` until it returns a truthy value (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
