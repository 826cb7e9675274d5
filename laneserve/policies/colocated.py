"""Colocated instances (prefill and decode on one instance, vLLM/Sarathi style): each step runs
every decode the decode policy picks, then fills the rest of the token budget with prefill chunks
from the prefill policy. Both share one KV cache; a finished prompt moves to the decode side
without a transfer."""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.kv import HostKVPool, KVCacheManager
from laneserve.core.plan import StepPlan, StepResult
from laneserve.core.request import Request
from laneserve.policies import registry
from laneserve.policies.base import InstanceScheduler, StepOutcome
from laneserve.policies.decode.base import DecodeScheduler
from laneserve.policies.options import PolicyOptions, at_least, option_defaults
from laneserve.policies.prefill.base import PrefillScheduler
from laneserve.policies.spec import PolicySpec


@dataclass(frozen=True, slots=True)
class ColocatedOptions(PolicyOptions):
    prefill: str | PolicySpec = "cp-edf:chunk=2048"     # the prefill side's policy: spec text or a typed PolicySpec
    decode: str | PolicySpec = "continuous"         # the decode side's policy: spec text or a typed PolicySpec
    token_budget: int = 2048               # tokens of one step (decodes + prefill chunks)

    def validate(self) -> None:
        PolicyOptions.validate(self)
        at_least(self, "token_budget", 1)
        for kind in ("prefill", "decode"):
            try:
                registry.resolve(kind, getattr(self, kind))
            except ValueError as exc:
                raise ValueError(f"option {kind}: {exc}") from None


@registry.register("colocated", "colocated")
class ColocatedScheduler(InstanceScheduler):
    """Options that are not :class:`ColocatedOptions` go to the prefill policy, as keywords
    (``prefix_caching=True``) or in the spec (``colocated:prefill=cp-edf,chunk=16``)."""

    role = "colocated"
    Options = ColocatedOptions
    forwards_options_to = "prefill"      # the registry reads the other spec options as the prefill policy's
    options: ColocatedOptions

    def __init__(self, kv: KVCacheManager, options: ColocatedOptions | None = None, *,
                 host_pool: HostKVPool | None = None, **opts) -> None:
        own = option_defaults(ColocatedOptions).keys()
        super().__init__(kv, options, **{k: v for k, v in opts.items() if k in own})
        o = self.options
        prefill_opts = {k: v for k, v in opts.items() if k not in own}
        self.prefill: PrefillScheduler = registry.make("prefill", o.prefill, kv, **prefill_opts)
        self.decode: DecodeScheduler = registry.make("decode", o.decode, kv, host_pool=host_pool)
        self.token_budget = o.token_budget
        self.name = f"colocated({self.prefill.name}+{self.decode.name})"
        self._prefill_plans: dict[int, StepPlan | None] = {}   # step plan id -> the prefill side's plan

    def add_request(self, req: Request, now: float) -> None:
        """A new request goes to the prefill side; one whose KV was reserved and imported here
        (a sample of an n-sample request, forked from its prompt) to the decode side."""
        if req.num_output_tokens:
            self.decode.add_request(req, now)
        else:
            self.prefill.add_request(req, now)

    def can_reserve(self, req: Request) -> bool:
        return self.decode.can_reserve(req)

    def reserve(self, req: Request) -> list[int]:
        return self.decode.reserve(req)

    def _enqueue(self, req: Request, now: float) -> None:  # pragma: no cover - add_request overrides
        raise NotImplementedError

    def _remove(self, req: Request) -> None:  # pragma: no cover - abort overrides
        raise NotImplementedError

    def schedule(self, now: float) -> StepPlan | None:
        plan = self.decode.schedule(now) or StepPlan()
        decode_only = plan.is_empty
        budget = self.token_budget - len(plan.decodes) - plan.num_prefill_tokens
        pplan = self.prefill.schedule(now, token_budget=budget) if budget > 0 else None
        if pplan is not None:
            plan.prefills.extend(pplan.prefills)
            if decode_only:
                plan.padded_shape = pplan.padded_shape     # a pure (possibly bucketed) prefill step
        if plan.is_empty:
            return None
        plan.label = self.name
        self._prefill_plans[plan.plan_id] = pplan
        return plan

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        # the prefill policy gets back its own plan object (its bookkeeping keys on it)
        pplan = self._prefill_plans.pop(plan.plan_id, None) or StepPlan()
        side = {id(c) for c in pplan.prefills}
        d_plan = StepPlan(prefills=[c for c in plan.prefills if id(c) not in side], decodes=plan.decodes)
        p_out = self.prefill.update(pplan, result, now)
        d_out = self.decode.update(d_plan, result, now)
        for req in p_out.prefilled:          # no transfer: the KV stays, decoding starts here
            self.prefill.requests.pop(req.request_id, None)
            self.decode.add_request(req, now)
        return StepOutcome(prefilled=[], finished=p_out.finished + d_out.finished)

    def next_wakeup(self) -> float | None:
        wakes = [w for w in (self.prefill.next_wakeup(), self.decode.next_wakeup()) if w is not None]
        return min(wakes) if wakes else None

    def abort(self, request_id: int, now: float, reason: str = "abort") -> Request | None:
        return self.prefill.abort(request_id, now, reason) or self.decode.abort(request_id, now, reason)

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting + self.decode.num_waiting

    @property
    def num_running(self) -> int:
        return self.decode.num_running

    @property
    def queued_tokens(self) -> int:
        return self.prefill.queued_tokens

    @property
    def has_work(self) -> bool:
        return self.prefill.has_work or self.decode.has_work

    # ---- hooks of the two sides ------------------------------------------------------------------
    @property
    def dropped_plans(self) -> list[StepPlan]:
        return self.prefill.dropped_plans

    @dropped_plans.setter
    def dropped_plans(self, value: list[StepPlan]) -> None:   # InstanceScheduler.__init__ sets one
        pass

    @property
    def kv_lands_in_host(self) -> bool:
        return self.decode.kv_lands_in_host

    @property
    def host_pool(self):
        return self.decode.host_pool

    @property
    def prefix_cache(self):
        return self.prefill.prefix_cache

    @property
    def prefix_caching(self) -> bool:
        return self.prefill.prefix_caching

    def bind_cost_model(self, cost_model) -> None:
        self.prefill.bind_cost_model(cost_model)
        self.decode.bind_cost_model(cost_model)

    def bind_prefix_cache(self, cache) -> None:
        self.prefill.bind_prefix_cache(cache)

    def cached_prefix(self, req: Request) -> int:
        return self.prefill.cached_prefix(req)

    @property
    def policy_preemptions(self) -> int:
        return self.decode.policy_preemptions
