"""One cluster runtime: what happens *between* instances, written once for every driver
(docs/design.md, "One cluster runtime").

A deployment is a frozen :class:`Deployment` (topology, policies, routers). From it a
:class:`ClusterRuntime` sets up the two routers once (:func:`make_routers`) and owns the three
decisions that cross instances:

- ``admit(req, now) -> instance``: a new request's prefill (or colocated) instance;
- ``on_prefilled(req, source, now) -> destination``: the hand-off of a finished prefill. The KV
  leaves ``source`` (exported and released there, :meth:`Instance.hand_off
  <laneserve.runtime.instance.Instance.hand_off>`, or, in the simulator, released when its
  transfer ends), a decode instance is chosen by the decode router among the accepting ones, and
  the KV is offered to it;
- ``on_lost(instance)``: an instance stopped (crashed, hung, or its node is gone): routers stop
  choosing it and the requests it held are named for the driver to fail.

A driver implements only how a KV payload travels (a :class:`KVLink`: ``take`` it from the
source, ``deliver`` it to the destination, ``discard`` it when nobody will read it) and what time
it is. The four drivers: the simulator (:mod:`laneserve.sim.simulator`: virtual time, a link that
queues transfers per destination), the in-process engine cluster
(:mod:`laneserve.cluster.local`: host copies between threads), and the process and Ray clusters
(:mod:`laneserve.cluster.process`: the source instance exports in its own process and sends a
transport descriptor, which the router forwards). Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from laneserve.core.request import Phase, Request
from laneserve.policies import registry
from laneserve.policies.routing import Router
from laneserve.runtime.spec import InstanceSpec, PolicySpec, as_spec, colocated_spec

#: the default policy pair of every entry point (``laneserve sim``/``serve``, ``ClusterConfig()``,
#: ``ClusterSpec``, ``LocalCluster``, ``LLM``)
DEFAULT_PREFILL_POLICY = "adaptive"
DEFAULT_DECODE_POLICY = "adaptive"
DEFAULT_ROUTER = "round-robin"
#: "auto": the decode policy's own (``preferred_decode_router``: tpot-aware for adaptive), else
#: least-loaded
DEFAULT_DECODE_ROUTER = "auto"
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True, slots=True)
class Deployment:
    """Topology and policies of one deployment. ``num_prefill`` counts the instances that take new
    requests: prefill instances, or colocated ones in ``colocated`` mode (which has no decode
    instances). A colocated instance runs ``colocated_policy``, by default the colocated policy
    composed of ``prefill_policy`` and ``decode_policy``. The policies are read once, here: the
    typed specs of both roles (``specs``) are computed when the deployment is made."""

    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    prefill_policy: str | PolicySpec = DEFAULT_PREFILL_POLICY
    decode_policy: str | PolicySpec = DEFAULT_DECODE_POLICY
    colocated_policy: str | PolicySpec | None = None
    router: str | PolicySpec = DEFAULT_ROUTER
    decode_router: str | PolicySpec = DEFAULT_DECODE_ROUTER
    #: (front policy, decode policy) as typed specs, resolved once in ``__post_init__``
    specs: tuple[PolicySpec, PolicySpec | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        if self.num_prefill < 1 or (not self.colocated and self.num_decode < 1):
            raise ValueError(f"a {self.mode} cluster needs at least one instance of each role")
        if not self.colocated:
            specs = (as_spec("prefill", self.prefill_policy), as_spec("decode", self.decode_policy))
        elif self.colocated_policy:
            specs = (as_spec("colocated", self.colocated_policy), None)
        else:
            specs = (colocated_spec(as_spec("prefill", self.prefill_policy),
                                    as_spec("decode", self.decode_policy)), None)
        object.__setattr__(self, "specs", specs)

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def front_policy(self) -> PolicySpec:
        """The policy of the instances that take new requests: in colocated mode the pair composed
        of the two typed specs (never formatted as one string and split again)."""
        return self.specs[0]

    def roles(self) -> list[tuple[str, PolicySpec]]:
        """(role, policy spec) of every instance, in instance-id order: the front ones first."""
        front, back = self.specs
        if self.colocated:
            return [("colocated", front)] * self.num_prefill
        return [("prefill", front)] * self.num_prefill + [("decode", back)] * self.num_decode

    def instance_specs(self, sizes: Callable[[str], dict[str, Any]]) -> tuple[InstanceSpec, ...]:
        """Every instance's :class:`InstanceSpec`, in instance-id order; ``sizes(role)``: the
        entry point's sizes for that role (KV tokens, host KV tokens, token budget, device,
        TP degree)."""
        return tuple(InstanceSpec(role, policy, **sizes(role)) for role, policy in self.roles())

    def decode_router_name(self) -> str | None:
        """The decode router, "auto" resolved (None in colocated mode: nothing is handed off)."""
        return None if self.colocated else registry.decode_router_for(self.specs[1], self.decode_router)

    def describe(self) -> str:
        front, back = self.specs
        if self.colocated:
            return f"{self.num_prefill}x colocated [{front}] router={self.router}"
        return f"{self.num_prefill}P[{front}] + {self.num_decode}D[{back}] router={self.router}"


def make_routers(deployment: Deployment, step_model: Callable[[], tuple[Any, Any]] | None = None,
                 ) -> tuple[Router, Router | None]:
    """The prefill router and the decode router (None in colocated mode) of ``deployment``. A
    decode router that ``reads_step_times`` is bound to ``step_model()``'s (model, learner): the
    run's predictor in the simulator, a model learned from the decode instances' steps on an engine."""
    router = registry.make("router", deployment.router)
    name = deployment.decode_router_name()
    if name is None:
        return router, None
    decode_router = registry.make("router", name)
    if decode_router.reads_step_times:
        if step_model is None:
            raise ValueError(f"decode router {name!r} predicts step times: the driver must give it a model")
        decode_router.bind_cost_model(*step_model())
    return router, decode_router


def learned_step_model(attention: str | None = None) -> tuple[Any, Any]:
    """(model, learner) for a decode router that predicts step times on an engine: one model
    learned from the decode instances' completed steps, for the engine's attention kernel (unset
    or ``auto``: ragged)."""
    from laneserve.policies.predictors import LearnedCostModel
    learner = LearnedCostModel(attention=attention if attention not in (None, "auto") else "ragged")
    return learner, learner


class KVLink(Protocol):
    """How a prefilled request's KV travels: the driver's half of a hand-off."""

    def take(self, source: Any, req: Request, now: float) -> Any:
        """The KV leaves ``source``: a payload for :meth:`deliver` (engines export it, and the
        source lets its blocks go, :meth:`Instance.hand_off`; the simulator keeps them until the
        transfer ends)."""

    def deliver(self, req: Request, destination: Any, payload: Any, now: float) -> None:
        """Offer ``req`` and its KV to ``destination``."""

    def discard(self, req: Request, payload: Any) -> None:
        """Nobody will read ``payload`` (no decode instance accepts)."""


class NoDestination(RuntimeError):
    """No decode instance accepts: the hand-off failed (its KV was discarded)."""


class ClusterRuntime:
    """The cross-instance decisions of one deployment. ``front`` (prefill or colocated) and
    ``back`` (decode) are the driver's instances as the routers read them
    (:class:`~laneserve.policies.routing.InstanceLoad`), in instance-id order; a driver that creates
    them later calls :meth:`attach`."""

    def __init__(self, deployment: Deployment, link: KVLink | None = None, *,
                 front: Sequence[Any] = (), back: Sequence[Any] = (),
                 step_model: Callable[[], tuple[Any, Any]] | None = None) -> None:
        self.deployment = deployment
        self.link = link
        self.router, self.decode_router = make_routers(deployment, step_model)
        self.front: Sequence[Any] = front
        self.back: Sequence[Any] = back

    def attach(self, front: Sequence[Any], back: Sequence[Any]) -> None:
        self.front, self.back = front, back

    @property
    def reads_step_times(self) -> bool:
        """Whether the decode router predicts step times (its decode instances record their last
        completed decode step, ``Instance.record_decode``)."""
        return self.decode_router is not None and self.decode_router.reads_step_times

    # ---- the three decisions -------------------------------------------------------------------
    def admit(self, req: Request, now: float) -> Any:
        """The front instance ``req`` goes to (``req.prefill_instance`` set to its id). Raises
        ``RuntimeError`` when none accepts."""
        inst = self.front[self.router.route(req, self.front, now)]
        req.prefill_instance = inst.instance_id
        return inst

    def on_prefilled(self, req: Request, source: Any, now: float, payload: Any = None) -> Any:
        """Hand ``req``'s prefill on ``source`` off to a decode instance, which is returned:
        ``req`` is in transfer, its KV leaves ``source`` (``link.take``; ``payload`` given: it
        already left, exported by ``source`` in its own process), the decode router picks the
        destination among the accepting decode instances (``req.decode_instance`` set) and the
        link delivers it there. Raises :class:`NoDestination` (the KV discarded) when none accepts."""
        req.phase = Phase.TRANSFERRING
        link = self.link
        if payload is None:
            payload = link.take(source, req, now)
        try:
            dest = self.route_decode(req, now)
        except RuntimeError as exc:
            link.discard(req, payload)
            raise NoDestination("no decode instance is available (all crashed or stopped)") from exc
        link.deliver(req, dest, payload, now)
        return dest

    def route_decode(self, req: Request, now: float) -> Any:
        back = self.back
        dest = back[self.decode_router.route(req, back, now)]
        req.decode_instance = dest.instance_id
        return dest

    def on_lost(self, instance: Any, held: Sequence[Any] = ()) -> list[Any]:
        """``instance`` stopped (crashed, hung, its node gone): the items of ``held`` (the driver's
        requests in flight: anything with an ``instance`` id) that were on it, for the driver to
        fail. Neither router chooses it again while its ``accepting`` is false (the driver's: a
        dead process, a restarting one)."""
        iid = instance.instance_id
        return [h for h in held if getattr(h, "instance", None) == iid]
