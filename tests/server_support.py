"""Shared helpers for tests that start ``laneserve serve`` on 127.0.0.1 (see
:mod:`laneserve.bench.live_server`)."""

from laneserve.bench.live_server import TIMEOUT, Server, free_port, serving, wait_all_free, wait_for  # noqa: F401
