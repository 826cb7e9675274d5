"""One way to build an instance from its :class:`~laneserve.runtime.spec.InstanceSpec`, for every
driver: the simulator, the in-process engine cluster, an instance process and ``LLM``. The spec
says *what* runs (role, policy, sizes); the driver's :class:`InstanceResources` say *on what*
(a KV manager of its kind, a host pool, a cost model or an executor, a clock, a rank group), so
the policy is resolved, the KV sized and the scheduler wired here once. Pure Python: the resources
that need torch are the engine's (:mod:`laneserve.engine.resources`), passed in."""

from __future__ import annotations

from typing import Any

from laneserve.policies import registry
from laneserve.policies.base import InstanceScheduler
from laneserve.runtime.spec import InstanceSpec


class InstanceResources:
    """What a driver supplies to :func:`build_instance`. Subclasses override :meth:`kv` and
    :meth:`instance`; the others have defaults (no host pool, no driver option defaults, no
    predictors)."""

    def kv(self, spec: InstanceSpec) -> Any:
        """The KV manager the scheduler allocates in, sized by ``spec.kv_tokens``."""
        raise NotImplementedError

    def host_pool(self, spec: InstanceSpec) -> Any:
        """The host KV pool of a decode-side instance (None: none)."""
        return None

    def policy_defaults(self, spec: InstanceSpec) -> dict[str, Any]:
        """Keyword defaults for the policy, overridden by the options its spec gives."""
        return {}

    def predictors(self) -> tuple[Any, Any] | None:
        """(model, learner) for a policy that reads step-time predictors (None: it keeps its own)."""
        return None

    def instance(self, instance_id: int, spec: InstanceSpec, scheduler: InstanceScheduler, kv: Any,
                 host: Any, learner: Any) -> Any:
        """The driver's instance around ``scheduler`` (its executor and clock)."""
        raise NotImplementedError


def build_instance(instance_id: int, spec: InstanceSpec, resources: InstanceResources) -> Any:
    """Instance ``instance_id`` of ``spec`` on ``resources``: its KV manager and host pool, its
    scheduler (the spec's policy, its options over the driver's defaults; a colocated step's
    token budget from the spec), the driver's predictors bound to a policy that reads them, then
    the driver's instance around it."""
    kv = resources.kv(spec)
    opts = dict(resources.policy_defaults(spec))
    host = None
    if spec.role != "prefill":
        host = resources.host_pool(spec)
        opts["host_pool"] = host
    if spec.token_budget is not None:
        opts["token_budget"] = spec.token_budget
    scheduler = registry.make(spec.role, spec.policy, kv, **opts)
    learner = None
    if type(scheduler).bind_cost_model is not InstanceScheduler.bind_cost_model:
        bound = resources.predictors()
        if bound is not None:
            model, learner = bound
            scheduler.bind_cost_model(model)
    return resources.instance(instance_id, spec, scheduler, kv, host, learner)
