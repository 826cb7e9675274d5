"""AlignedServe's GPU-prefetch-for-GPU staging, as a timeline (AlignedServe §3.2, §3.4, §4.4).

The paper keeps the candidate-batch and candidate-requests buffers in a prefill GPU's HBM: a
batch chosen from the host KV pool is copied host -> peer GPU over PCIe *while the running batch
decodes*, and moved peer GPU -> decode GPU over NVLink when it is admitted.

The model (documented choice): the host pool keeps the authoritative copy of a staged request's
KV (its blocks stay allocated in the :class:`~laneserve.core.kv.HostKVPool` until swap-in); the
peer-GPU copy is a cache with a token capacity. Staging copies run one after another on a
background PCIe link at ``tokens_per_s`` and cost the decode instance nothing *unless* a request
is needed before its copy is done: such a request is not admitted yet, and an instance with
nothing else to run waits (``next_wakeup``) for it — so prefetch time is charged exactly where
it exceeds the decode steps it overlaps. The NVLink leg is on the critical path: the scheduler
emits it as ``plan.swap_in`` and the simulator charges it at ``ClusterConfig.swap_link``
(``"nvlink"`` for this design; ``"pcie"`` with ``prefetch=False`` for direct host -> decode
copies, the paper's "w/o P" ablation). ``tokens_per_s=None`` means an instantaneous stage (the
CPU engine, whose pool and device both live in host memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.core.request import Request
from laneserve.policies.decode.mechanisms.aligned_stats import Aligned


@dataclass(slots=True)
class PrefetchStager:
    tokens_per_s: float | None = None
    capacity_tokens: int = 1 << 62
    link_free_at: float = 0.0
    staged_tokens: int = 0
    staged_total: int = 0          # tokens ever staged (statistics)
    wait_events: int = 0           # admissions that found their request not staged yet

    def can_stage(self, tokens: int) -> bool:
        return self.staged_tokens + tokens <= self.capacity_tokens

    def stage(self, req: Request, tokens: int, now: float, *, immediate: bool = False) -> float:
        """Start (or, for an eviction already on the peer GPU, record) the staging copy of
        ``req``; returns when it is ready."""
        if immediate or self.tokens_per_s is None:
            ready = now
        else:
            start = self.link_free_at if self.link_free_at > now else now
            ready = start + tokens / self.tokens_per_s
            self.link_free_at = ready
        state = req.policy_state.of(Aligned)
        state.prefetch_ready, state.prefetch_staged = ready, tokens
        self.staged_tokens += tokens
        self.staged_total += tokens
        return ready

    def unstage(self, req: Request) -> None:
        state = req.policy_state.of(Aligned)
        tokens, state.prefetch_staged, state.prefetch_ready = state.prefetch_staged, 0, 0.0
        self.staged_tokens -= tokens

    @staticmethod
    def ready_at(req: Request) -> float:
        return req.policy_state.of(Aligned).prefetch_ready
