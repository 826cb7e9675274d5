"""Straightforward reference forms of the incremental prefill policies: every
decision re-ranks the whole waiting queue, as the policies did before their queues became
incremental. Test code: ``tests/test_policy_incremental.py`` runs each beside its optimised
twin and asserts identical plans step for step."""

from __future__ import annotations

from collections.abc import Iterator

from laneserve.core.plan import StepPlan
from laneserve.core.request import Request
from laneserve.policies.prefill.adaptive import AdaptivePrefill
from laneserve.policies.prefill.sedf import SEDFPrefill
from laneserve.policies.prefill.base import PrefillScheduler
from laneserve.policies.prefill.fcfs import FCFSPrefill
from laneserve.policies.prefill.kairos import KairosPrefill
from laneserve.policies.prefill.laps import LapsPrefill
from laneserve.policies.prefill.mechanisms.laps_lanes import Lane
from laneserve.policies.prefill.mechanisms.priority import PriorityKey
from laneserve.policies.prefill.mechanisms.sedf_ordering import SEDFOrdering


class ScanSEDFOrdering(SEDFOrdering):
    """The S-EDF ordering with a full sort of the waiting requests per decision and Algorithm 1
    walking every candidate."""

    def wait(self, req: Request) -> None:
        self.waiting[req.request_id] = req

    def unwait(self, request_id: int) -> None:
        self.waiting.pop(request_id, None)

    def ranked(self, now: float) -> Iterator[tuple[PriorityKey, Request]]:
        return iter(sorted(((self.req_key(r, now), r) for r in self.waiting.values()), key=lambda kr: kr[0]))

    def best_key(self, now: float) -> PriorityKey | None:
        return min((self.req_key(r, now) for r in self.waiting.values()), default=None)

    def batch_closed(self, tokens: int, limit: int, t_remain: float) -> bool:
        return False

    def candidates(self, walk, head_key, bound, fresh_bound=None):
        return (r for _, r in walk)

    def admissible(self, walk, after, fresh_bound):
        return walk


class SEDFPrefillReference(SEDFPrefill):
    """S-EDF (and its orderings) holding the scanning ordering."""

    def compose_sedf(self, o, ordering_class=SEDFOrdering, **parts) -> None:
        super().compose_sedf(o, ScanSEDFOrdering, **parts)


class AdaptivePrefillReference(AdaptivePrefill):
    """Adaptive prefill holding the scanning ordering; its Algorithm 1 walks every candidate, the
    lanes refusing the other lane's requests one by one (``may_join``)."""

    def compose_sedf(self, o, ordering_class=SEDFOrdering, **parts) -> None:
        super().compose_sedf(o, ScanSEDFOrdering, **parts)
        self.batcher._candidates = lambda head, walk, head_key, bound, fresh_bound: (r for _, r in walk)


class KairosPrefillReference(KairosPrefill):
    """Kairos prefill with the Python FCFS walk and a full sort of the scores per decision."""

    def _enqueue_slot(self, req: Request) -> None:
        pass

    def _drop_slot(self, req: Request) -> None:
        pass

    def _touch(self, req: Request) -> None:
        pass

    def _remove(self, req: Request) -> None:
        PrefillScheduler._remove(self, req)

    def schedule(self, now: float, token_budget: int | None = None) -> StepPlan | None:
        if not self.queue:
            return None
        return self._fill((req for _, req in self._sorted_scores(now)), now, token_budget)


class ScanLane(Lane):
    """A LAPS lane that scans its list for every minimum and removal."""

    __slots__ = ()

    def remove(self, req: Request) -> bool:
        try:
            self.items.remove(req)
            return True
        except ValueError:
            return False

    def min_deadline(self) -> float:
        return min(r.ttft_deadline for r in self.items)

    def min_arrival(self) -> float:
        return min(r.arrival_time for r in self.items)


class LapsPrefillReference(LapsPrefill):
    """LAPS with scanning lanes and uncounted length buckets (every batch walk goes to the end)."""

    def __init__(self, kv, **opts) -> None:
        super().__init__(kv, **opts)
        self.lanes = {name: ScanLane(name, lane.order) for name, lane in self.lanes.items()}


class FCFSPrefillReference(FCFSPrefill):
    """FCFS whose removals search the whole queue."""

    _remove = PrefillScheduler._remove
