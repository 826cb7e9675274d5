"""The API server's life: its port answers at once, its connections are bounded in time, and it
ends cleanly whatever happens.

- **Starting.** The HTTP port opens before the instances are loaded; until they are, requests and
  ``/health`` get 503 with ``Retry-After`` (``ServerState.phase == "starting"``), not a refused
  connection. A start-up failure (an instance that cannot load, a bad engine option) ends the
  process promptly with one line on stderr and exit code 2.
- **Connections.** A connection must send a request's headers within ``header_timeout`` seconds
  of opening (or of its previous response): idle and slowloris connections are closed; uvicorn's
  keep-alive timeout closes idle keep-alive connections; ``api.py`` bounds the body's arrival.
- **Draining.** On SIGTERM/SIGINT the server stops admitting (503) and gives running requests
  ``shutdown_timeout`` seconds; then every request still running ends with an error (an SSE
  ``error`` event then ``[DONE]`` on a stream, a 503 otherwise) before uvicorn closes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

DRAIN_MARGIN = 2.0          # uvicorn's own graceful timeout runs this much longer than the drain


def guarded_protocol(header_timeout: float):
    """uvicorn's httptools protocol with a header-read deadline (None where httptools is missing)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:                   # pragma: no cover - httptools is a declared dependency
        return None

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()                   # the next request's headers are due in time too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class Lifecycle:
    """Start-up in the background and the drain deadline, around one ``uvicorn.Server``."""

    def __init__(self, state, cluster, start: Callable[[], Awaitable[None]], *, shutdown_timeout: float,
                 log: Callable[[str], None]) -> None:
        self.state, self.cluster, self._start = state, cluster, start
        self.shutdown_timeout = shutdown_timeout
        self.log = log
        self.server = None                # the uvicorn.Server, once run() made it
        self.failure: str | None = None
        self._tasks: list[asyncio.Task] = []

    def begin(self) -> None:
        """Called from the app's lifespan: load the instances and watch for a drain."""
        self.state.phase = "starting"
        self._tasks = [asyncio.create_task(self._load(), name="laneserve-start"),
                       asyncio.create_task(self._watch_drain(), name="laneserve-drain")]

    async def end(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t

    async def _load(self) -> None:
        try:
            await self._start()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any start-up failure ends the server with one line
            self.failure = one_line(exc)
            self.state.phase = "failed"
            self.log(f"laneserve: error: {self.failure}")
            if self.server is not None:
                self.server.should_exit = True
            return
        self.state.phase = "ready"

    async def _watch_drain(self) -> None:
        while self.server is None or not self.server.should_exit:
            await asyncio.sleep(0.05)
        self.cluster.draining = True             # admission answers 503 from now on
        deadline = asyncio.get_running_loop().time() + self.shutdown_timeout
        while self.cluster.tracks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.cluster.tracks:
            n = self.cluster.fail_all(f"server shutting down: requests still running after --shutdown-timeout "
                                      f"{self.shutdown_timeout:g} s were ended")
            self.log(f"laneserve: drain timeout: ended {n} running request(s)")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_server(app, lifecycle: Lifecycle, *, host: str, port: int, header_timeout: float,
               keep_alive_timeout: float, log_level: str = "warning") -> int:
    """Serve until a signal or a start-up failure; the exit code (0, or 2 when start-up failed)."""
    import uvicorn

    protocol = guarded_protocol(header_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="auto",
                            http=protocol or "auto", timeout_keep_alive=keep_alive_timeout,
                            timeout_graceful_shutdown=lifecycle.shutdown_timeout + DRAIN_MARGIN)
    server = uvicorn.Server(config)
    lifecycle.server = server
    server.run()
    if lifecycle.failure is not None:
        return 2
    if not server.started:
        print("laneserve: error: the server did not start (see above)", file=sys.stderr)
        return 2
    return 0
