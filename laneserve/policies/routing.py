"""Request routers: which prefill (or colocated) instance takes an arriving request, and which
decode instance takes a finished prefill. Baselines: round-robin and least-loaded. Routers see
instances only through :class:`InstanceLoad`, so the engine cluster and the simulator share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from typing import ClassVar, Protocol

from laneserve.core.request import Request
from laneserve.policies.options import PolicyOptions, at_least, build_options, within
from laneserve.policies.registry import register


@dataclass(frozen=True, slots=True)
class DecodeSummary:
    """A decode instance's next step, summed for a router (``tpot-aware``): how many requests,
    their context sum and longest context, and their TPOT targets as ``(target, count)`` pairs.
    The simulator's and the engine's instances build it from their residents; an instance process
    sends it in its stats (``to_wire``), so the server's router reads the same figures."""

    count: int = 0
    total: int = 0
    longest: int = 0
    tpots: tuple[tuple[float, int], ...] = ()

    @classmethod
    def of(cls, residents: Sequence[Request]) -> DecodeSummary:
        if not residents:
            return cls()
        contexts = [r.context_len for r in residents]
        targets: dict[float, int] = {}
        for r in residents:
            t = r.slo.tpot
            if t is not None:
                targets[t] = targets.get(t, 0) + 1
        return cls(len(contexts), sum(contexts), max(contexts), tuple(targets.items()))

    def to_wire(self) -> list:
        return [self.count, self.total, self.longest, [list(p) for p in self.tpots]]

    @classmethod
    def from_wire(cls, m) -> DecodeSummary:
        count, total, longest, tpots = m
        return cls(int(count), int(total), int(longest), tuple((float(t), int(n)) for t, n in tpots))


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

    def decode_residents(self, limit: int | None = None) -> list[Request]:
        """The requests the instance holds, then those it has been offered, in arrival order: the
        first ``limit`` (decode side: what its next steps decode)."""
        held = chain(self.scheduler.requests.values(), self._outside())
        return list(held if limit is None else islice(held, limit))

    def decode_summary(self) -> DecodeSummary:
        """What a decode step of this instance would hold, summed (:class:`DecodeSummary`): its
        first ``max_batch_size`` residents (:meth:`decode_residents`)."""
        return DecodeSummary.of(self.decode_residents(getattr(self.scheduler, "max_batch_size", None)))

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens of ``req`` this instance holds in its prefix cache (0 without one)."""
        probe = getattr(self.scheduler, "cached_prefix", None)
        return probe(req) if probe is not None else 0


def cached_prefix(inst: InstanceLoad, req: Request) -> int:
    """``inst.cached_prefix(req)`` for instances that expose one, else 0."""
    probe = getattr(inst, "cached_prefix", None)
    return probe(req) if probe is not None else 0


class Router:
    name = "router"
    #: the router's typed options (policies/options.py); ``self.options`` holds the frozen value
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions

    def __init__(self, options: PolicyOptions | None = None, **opts) -> None:
        self.options = build_options(type(self).Options, options, opts)

    #: the router predicts decode step times: a driver binds the run's predictor to it
    #: (:meth:`bind_cost_model`) and has its decode instances record their last completed decode
    #: step (``Instance.last_decode``)
    reads_step_times: ClassVar[bool] = False
    learner = None          # the online model a router that reads step times fits (bind_cost_model)

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        """Index into ``instances`` of the chosen one."""
        raise NotImplementedError

    def bind_cost_model(self, model, learner=None) -> None:
        """The model a router that ``reads_step_times`` predicts with, and (online) the learner it
        feeds with observed steps; others ignore it."""

    @staticmethod
    def _candidates(instances: Sequence[InstanceLoad]) -> list[int]:
        live = [i for i, inst in enumerate(instances) if inst.accepting]
        if not live:
            raise RuntimeError("no instance is accepting requests")
        return live


@register("router", "round-robin", aliases={"rr": {}})
class RoundRobinRouter(Router):
    name = "round-robin"
    Options = PolicyOptions

    def __init__(self, options: PolicyOptions | None = None, **opts) -> None:
        super().__init__(options, **opts)
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
    Options = PolicyOptions

    def __init__(self, options: PolicyOptions | None = None, **opts) -> None:
        super().__init__(options, **opts)
        self._last_pick: dict[int, int] = {}
        self._picks = 0

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        return self.pick(instances, self._candidates(instances))

    def pick(self, instances: Sequence[InstanceLoad], candidates: Sequence[int]) -> int:
        """The least-loaded of ``candidates`` (indices of accepting instances)."""
        last = self._last_pick
        if instances[candidates[0]].role == "decode":
            def key(i: int) -> tuple:
                return (instances[i].kv_usage, instances[i].num_running + instances[i].num_waiting,
                        last.get(i, -1), i)
        else:
            def key(i: int) -> tuple:
                return (instances[i].queued_tokens, instances[i].num_waiting, last.get(i, -1), i)
        choice = min(candidates, key=key)
        self._picks += 1
        last[choice] = self._picks
        return choice


@dataclass(frozen=True, slots=True)
class CacheAwareOptions(PolicyOptions):
    threshold: float = 0.5          # least share of the prompt cached for affinity to count
    balance_tokens: int = 16384     # how many more queued tokens the preferred instance may hold

    def validate(self) -> None:
        PolicyOptions.validate(self)
        within(self, "threshold", 0.0, 1.0)
        at_least(self, "balance_tokens", 0)


@register("router", "cache-aware")
class CacheAwareRouter(Router):
    """Prefix-cache affinity with a load guard (the idea of SGLang's cache-aware router, over the
    instances' own caches). Prefill side: the instance holding the longest cached prefix of the
    prompt, when that prefix is at least ``threshold`` of the prompt and that instance's queued
    tokens exceed the least-loaded instance's by at most ``balance_tokens``; otherwise (and on the
    decode side) least-loaded. Ties between equal prefixes go to the less loaded instance."""

    name = "cache-aware"
    Options = CacheAwareOptions
    options: CacheAwareOptions

    def __init__(self, options: CacheAwareOptions | None = None, **opts) -> None:
        super().__init__(options, **opts)
        self.threshold, self.balance_tokens = self.options.threshold, self.options.balance_tokens
        self.fallback = LeastLoadedRouter()
        self.affinity_picks = 0

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        live = self._candidates(instances)
        if instances[live[0]].role == "decode":
            return self.fallback.pick(instances, live)
        preferred = affinity_candidates(req, instances, live, self.threshold, self.balance_tokens)
        if preferred is None:
            return self.fallback.pick(instances, live)
        self.affinity_picks += 1
        return self.fallback.pick(instances, preferred)


def affinity_candidates(req: Request, instances: Sequence[InstanceLoad], candidates: Sequence[int],
                        threshold: float, balance_tokens: int,
                        hits: Mapping[int, int] | None = None) -> list[int] | None:
    """The candidates holding the longest cached prefix of ``req``, if it covers ≥ ``threshold``
    of the prompt and only some candidates hold it, keeping those whose queue is within
    ``balance_tokens`` of the shortest; None when no candidate is to be preferred. ``hits`` (index
    -> cached tokens) saves the lookups when the caller already made them."""
    if not candidates:
        return None
    if hits is None:
        hits = {i: cached_prefix(instances[i], req) for i in candidates}
    top = max(hits[i] for i in candidates)
    if top <= 0 or top < threshold * req.prompt_len:
        return None
    preferred = [i for i in candidates if hits[i] == top]
    if len(preferred) == len(candidates):
        return None                                    # everyone holds it: nothing to prefer
    lightest = min(instances[i].queued_tokens for i in candidates)
    preferred = [i for i in preferred if instances[i].queued_tokens - lightest <= balance_tokens]
    return preferred or None
