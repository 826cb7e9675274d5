"""Session-wide fixtures.

``shared_server``: live ``laneserve serve`` processes shared by the test modules that start one with
the same flags and leave it as they found it (no instance killed or restarted, no server setting
changed). Each costs seconds of start-up (every instance process imports torch and loads the
model), so one per configuration for the whole session rather than one per module. A module that
kills instances, changes what the server is, or needs flags of its own keeps its own server.
Every server started here is stopped at the end of the session by its own handle."""

from __future__ import annotations

import pytest

from server_support import Server


@pytest.fixture(scope="session")
def shared_server():
    """``shared_server(*ARGS)``: the session's ``laneserve serve ARGS`` (started on first use); call
    ``.wait_ready()`` on it (at once when it is up), so a module can start several in parallel."""
    servers: dict[tuple[str, ...], Server] = {}

    def get(*args: str) -> Server:
        if args not in servers:
            servers[args] = Server(*args)
        server = servers[args]
        if server.proc.poll() is not None:
            raise RuntimeError(f"the shared server {args} exited (code {server.proc.returncode})")
        return server

    try:
        yield get
    finally:
        for server in servers.values():
            server.interrupt()
        for server in servers.values():
            server.stop()
