"""The scheduler contract every policy implements (docs/design.md, "The central contract").

One instance is one loop::

    plan = scheduler.schedule(now)         # who runs, how many tokens, who is preempted
    result = executor.execute(plan)        # engine (torch) or simulator (cost model)
    outcome = scheduler.update(plan, result, now)

Schedulers own request state changes (counters, phases, timestamps) and KV admission on their
instance's :class:`~laneserve.core.kv.KVCacheManager`; executors only read them. Policies are
event-driven: the loop calls ``schedule`` after an arrival, a finished step, a KV arrival or a
wake-up the policy asked for with :meth:`InstanceScheduler.next_wakeup`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import PrefillChunk, StepPlan, StepResult
from laneserve.core.request import Phase, Request
from laneserve.policies.options import PolicyOptions, build_options


@dataclass(slots=True)
class StepOutcome:
    """What a step changed that the instance loop must act on."""

    prefilled: list[Request] = field(default_factory=list)   # prompt done; hand off to decode
    finished: list[Request] = field(default_factory=list)    # done (all tokens, stop, or abort)


class InstanceScheduler(ABC):
    """Base of prefill, decode and colocated schedulers: queue bookkeeping and the common
    ``update`` rule (a request is counters over its token list)."""

    role: str = "prefill"
    name: str = "base"
    # What the instance runtime and the routers may ask of any policy (defaults: the policy has none)
    kv_lands_in_host: bool = False        # incoming KV is imported into the host pool (AlignedServe)
    host_pool = None                      # the decode side's host KV pool, if any
    prefix_cache = None                   # the prefill side's prefix cache, if bound
    prefix_caching: bool = False          # the policy reuses cached prompt prefixes
    needs_host_pool: bool = False         # refuses to run without a host KV pool (the simulator gives a default)
    #: a decode-only plan runs every running request, and the next plans stay the same batch until
    #: an event (KV arrival, abort), a request finishing or a KV growth that does not fit: a
    #: simulator may run such steps as one event (sim/macro.py); policies deciding per step opt out
    stable_decode_batch: bool = False
    #: the policy's typed options (policies/options.py); ``self.options`` holds the frozen value
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions

    def __init__(self, kv: KVCacheManager, options: PolicyOptions | None = None, **opts) -> None:
        self.kv = kv
        self.options = build_options(type(self).Options, options, opts)
        self.requests: dict[int, Request] = {}     # every request this instance holds
        self.dropped_plans: list[StepPlan] = []     # parked plans given up (a member aborted)

    # ---- events --------------------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id} already on this instance")
        self.requests[req.request_id] = req
        self._enqueue(req, now)

    @abstractmethod
    def _enqueue(self, req: Request, now: float) -> None: ...

    def offer_end(self, pending: Sequence[tuple[Request, Any]], now: float) -> int:
        """Which end of the offered KV transfers (``(request, payload)`` pairs, oldest first, never
        empty) the instance takes in next: 0, the oldest (the default), or -1, the newest."""
        return 0

    @abstractmethod
    def schedule(self, now: float) -> StepPlan | None:
        """The next step to run, or ``None`` to idle until the next event or wake-up."""

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutcome:
        outcome = StepOutcome()
        if not result.completed:      # stopped at a boundary: nothing advanced, plan is parked
            self._on_preempted(plan, now)
            return outcome
        sampled = result.sampled
        stop_hit = result.stop_hit
        for chunk in plan.prefills:
            self._advance_prefill(chunk, sampled, stop_hit, now, outcome)
        for req in plan.decodes:
            self._advance_decode(req, sampled, stop_hit, now, outcome)
        if self.kv.prefix_caching:           # name the blocks this step filled, before any is freed
            for chunk in plan.prefills:
                self.kv.register(chunk.request)
            for req in plan.decodes:
                self.kv.register(req)
        self._after_update(plan, outcome, now)
        return outcome

    def abort(self, request_id: int, now: float, reason: str = "abort") -> Request | None:
        """Drop a request wherever it is on this instance and free its KV. ``reason`` is the
        finish reason recorded ("abort" for a cancelled request, "stop" for a stop string the
        instance loop detected after detokenising)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._remove(req)
        self.kv.free(request_id)
        if not req.is_finished:
            req.finish(now, reason)
        return req

    def release(self, request_id: int) -> None:
        """Forget a request whose KV has left this instance (transfer done) and free its blocks."""
        self.requests.pop(request_id, None)
        self.kv.free(request_id)

    # ---- hooks ---------------------------------------------------------------------------
    def should_preempt(self, running: StepPlan, now: float) -> bool:
        """Asked on an arrival while a preemptible step runs (FlowPrefill Algorithm 2)."""
        return False

    def next_wakeup(self) -> float | None:
        """A time at which ``schedule`` should be called even without an event (AWD windows)."""
        return None

    def bind_cost_model(self, cost_model) -> None:
        """The model the policy's predictors read, when it has any (:mod:`laneserve.policies.predictors`:
        the run's own cost model, a profile fit, or a model the instance learns online)."""

    def bind_prefix_cache(self, cache) -> None:
        """Give the policy its instance's prefix cache (policies run with ``prefix_caching``)."""

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens of ``req`` this instance holds cached (0 without a prefix cache)."""
        return 0

    def set_lane(self, lane: str | None) -> None:
        """The length lane a pool router assigned this instance (LAPS' spatial mode)."""

    @property
    def policy_preemptions(self) -> int:
        """Preemptions the policy makes between steps (decode swaps and recomputes). A step stopped
        at an operator boundary is counted by the instance runtime, not here."""
        return 0

    def _on_preempted(self, plan: StepPlan, now: float) -> None:
        for chunk in plan.prefills:
            chunk.request.phase = Phase.PREEMPTED

    def _after_update(self, plan: StepPlan, outcome: StepOutcome, now: float) -> None:
        """Subclass bookkeeping after counters advanced (remove finished from queues...)."""

    @abstractmethod
    def _remove(self, req: Request) -> None:
        """Take ``req`` out of this policy's queues."""

    # ---- load figures (routing, pressure, metrics) ---------------------------------------
    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    def queued_tokens(self) -> int:
        """Work still to do here, in tokens (prefill: prompt tokens; decode: running requests)."""
        return sum(r.remaining_prefill for r in self.requests.values())

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- the common counter rule ---------------------------------------------------------
    def _advance_prefill(self, chunk: PrefillChunk, sampled: dict[int, int] | None,
                         stop_hit: set[int] | None, now: float, outcome: StepOutcome) -> None:
        req = chunk.request
        req.num_computed_tokens = chunk.end
        if req.num_output_tokens:        # a recompute after preemption: KV restored, no new token
            return
        if chunk.end < req.prompt_len:
            req.phase = Phase.PREFILLING
            return
        req.times.prefill_end = now
        rid = req.request_id
        req.record_token(now, sampled.get(rid) if sampled else None)
        if req.num_output_tokens >= req.max_output_tokens or (stop_hit and rid in stop_hit):
            req.finish(now, "stop" if stop_hit and rid in stop_hit else "length")
            outcome.finished.append(req)
        else:
            outcome.prefilled.append(req)

    def _advance_decode(self, req: Request, sampled: dict[int, int] | None,
                        stop_hit: set[int] | None, now: float, outcome: StepOutcome) -> None:
        req.num_computed_tokens += 1
        rid = req.request_id
        req.record_token(now, sampled.get(rid) if sampled else None)
        if req.num_output_tokens >= req.max_output_tokens:
            req.finish(now, "length")
            outcome.finished.append(req)
        elif stop_hit and rid in stop_hit:
            req.finish(now, "stop")
            outcome.finished.append(req)
