"""Request routers: which prefill (or colocated) instance takes an arriving request, and which
decode instance takes a finished prefill. Baselines: round-robin and least-loaded. Routers see
instances only through :class:`InstanceLoad`, so the engine cluster and the simulator share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from laneserve.core.request import Request
from laneserve.policies.registry import register


class InstanceLoad(Protocol):
    """What a router may look at on an instance."""

    instance_id: int
    role: str

    @property
    def queued_tokens(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def accepting(self) -> bool: ...


class SchedulerLoad:
    """The router-facing figures of an instance that wraps a scheduler (``self.scheduler``), shared
    by the simulator's and the engine's instances. ``_outside()`` gives the requests queued at the
    instance but not yet in its scheduler (inbox, incoming transfers)."""

    __slots__ = ()

    def _outside(self) -> list[Request]:
        return []

    @property
    def queued_tokens(self) -> int:
        return self.scheduler.queued_tokens + sum(r.remaining_prefill for r in self._outside())

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self._outside())

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv.usage


class Router:
    name = "router"

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        """Index into ``instances`` of the chosen one."""
        raise NotImplementedError

    @staticmethod
    def _candidates(instances: Sequence[InstanceLoad]) -> list[int]:
        live = [i for i, inst in enumerate(instances) if inst.accepting]
        if not live:
            raise RuntimeError("no instance is accepting requests")
        return live


@register("router", "round-robin", aliases={"rr": {}})
class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        n = len(instances)
        for k in range(n):
            i = (self._next + k) % n
            if instances[i].accepting:
                self._next = i + 1
                return i
        raise RuntimeError("no instance is accepting requests")


@register("router", "least-loaded", aliases={"ll": {}})
class LeastLoadedRouter(Router):
    """Prefill side: fewest queued prompt tokens. Decode side: lowest KV usage, then fewest
    requests. Ties go to the instance chosen least recently, so an idle cluster still spreads
    requests; the choice is deterministic."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._last_pick: dict[int, int] = {}
        self._picks = 0

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        live = self._candidates(instances)
        last = self._last_pick
        if instances[live[0]].role == "decode":
            key = lambda i: (instances[i].kv_usage, instances[i].num_running + instances[i].num_waiting,
                             last.get(i, -1), i)
        else:
            key = lambda i: (instances[i].queued_tokens, instances[i].num_waiting, last.get(i, -1), i)
        choice = min(live, key=key)
        self._picks += 1
        last[choice] = self._picks
        return choice
