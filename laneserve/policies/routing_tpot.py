"""``tpot-aware``: decode placement that keeps long contexts from slowing everyone's tokens.

A decode step's time is set by more than the batch's total KV: on a ragged attention kernel each
request's attention runs on the blocks of its own heads, so one long context puts a floor under
the whole step (Llama-3.1-8B/H100 analytic model: a 64K-token request makes a 31-request step
63 ms, where 31 requests of 1K tokens take 10 ms). Least-loaded placement spreads such requests
over every decode instance, and every short request that shares an instance with one misses a
50 ms TPOT target for as long as it stays there. On the league's Kairos workload (Mooncake
lengths, 4P+4D) that, not prefill, is what bounds every policy's goodput.

Decode side, for a request of context ``L`` with TPOT target ``τ``, on each accepting instance:
the predicted step time of its residents (the requests it holds, then those it has been offered,
in arrival order: the first ``max_batch_size``, as many as a step decodes) before and after adding
the request, ``before`` and ``after``; ``broken`` = residents whose target ``before``
meets and ``after`` does not; ``fits`` = ``after <= τ``. The request goes to the instances with
the fewest ``broken``, then those where it ``fits``, and among them to the least-loaded. So a
request that breaks nobody and meets its own target anywhere is placed as least-loaded places it
(all short traffic: exactly least-loaded's choice); a long request no instance can serve within
its target joins an instance already slowed by a long context, where it breaks nobody, and the
short ones go where no long context is. Prefill side: least-loaded.

Predictions come from the run's predictor (``bind_cost_model``): online (default), a
:class:`~laneserve.policies.predictors.LearnedCostModel` the router fits from the last completed
decode step of each decode instance, read at each decision (``Instance.last_decode``, recorded
because ``reads_step_times`` asks for it); oracle, the run's cost model; profile, the offline
fit. ``laneserve serve`` binds an online model too: its instance processes send the summary of
their next step (:class:`~laneserve.policies.routing.DecodeSummary`) and their last decode step in
their stats, so the server's router reads them as of the last stats (50 ms while busy). Without a
bound model (the in-process ``LocalCluster``) it is least-loaded.

Cost: one pass over at most ``max_batch_size`` residents of each decode instance per placement
(about 0.1 ms per thousand on the 2-core dev machine), however long its queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from laneserve.core.request import Request
from laneserve.costmodel.base import decode_summary_time
from laneserve.policies.options import PolicyOptions
from laneserve.policies.registry import register
from laneserve.policies.routing import InstanceLoad, LeastLoadedRouter, Router


@register("router", "tpot-aware")
class TpotAwareRouter(Router):
    name = "tpot-aware"
    Options = PolicyOptions
    reads_step_times = True

    def __init__(self, options: PolicyOptions | None = None, **opts) -> None:
        super().__init__(options, **opts)
        self.fallback = LeastLoadedRouter()
        self.model: Any = None
        self.learner: Any = None
        self._seen: dict[int, tuple] = {}
        self.narrowed = 0           # decode placements where some accepting instance was ruled out

    def bind_cost_model(self, model: Any, learner: Any = None) -> None:
        self.model, self.learner = model, learner

    def route(self, req: Request, instances: Sequence[InstanceLoad], now: float) -> int:
        live = self._candidates(instances)
        if self.model is None or len(live) == 1 or instances[live[0]].role != "decode":
            return self.fallback.pick(instances, live)
        if self.learner is not None:
            self._observe(instances)
        model, length = self.model, req.context_len
        target = req.slo.tpot if req.slo.tpot is not None else math.inf
        keys: dict[int, tuple[int, bool]] = {}
        for i in live:
            s = instances[i].decode_summary()
            if not s.count:
                keys[i] = (0, decode_summary_time(model, 1, length, length) > target)
                continue
            before = decode_summary_time(model, s.count, s.total, s.longest)
            after = decode_summary_time(model, s.count + 1, s.total + length, max(s.longest, length))
            broken = sum(k for tpot, k in s.tpots if before <= tpot < after) if after > before else 0
            keys[i] = (broken, after > target)
        best = min(keys.values())
        chosen = [i for i in live if keys[i] == best]
        if len(chosen) == len(live):
            return self.fallback.pick(instances, live)
        self.narrowed += 1
        return self.fallback.pick(instances, chosen)

    def _observe(self, instances: Sequence[InstanceLoad]) -> None:
        """Feed the learner each instance's last completed decode step, once."""
        seen = self._seen
        for inst in instances:
            step = getattr(inst, "last_decode", None)
            if step is not None and seen.get(inst.instance_id) is not step:
                seen[inst.instance_id] = step
                self.learner.observe_decode_summary(*step)
