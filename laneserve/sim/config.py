"""Cluster shape and policy selection for a simulation run (frozen; the CLI maps flags here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laneserve.policies.predictors import PREDICTORS
from laneserve.policies import registry
from laneserve.policies.spec import PolicySpec
from laneserve.runtime.cluster import (DEFAULT_DECODE_POLICY, DEFAULT_DECODE_ROUTER, DEFAULT_PREFILL_POLICY,
                                       DEFAULT_ROUTER, Deployment)
from laneserve.runtime.spec import InstanceSpec

#: host memory per GPU behind the default host KV pool: a DGX H100 has 2 TB of host memory for
#: its 8 GPUs (NVIDIA DGX H100 user guide)
HOST_BYTES_PER_GPU = 2 * 10**12 // 8


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    #: "disaggregated" (prefill and decode instances, KV transfer) or "colocated"
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 1
    #: the policies: every entry point's default pair (runtime.cluster), adaptive prefill and decode
    prefill_policy: str = DEFAULT_PREFILL_POLICY
    decode_policy: str = DEFAULT_DECODE_POLICY
    #: colocated mode's policy; None: the colocated policy of prefill_policy and decode_policy
    colocated_policy: str | PolicySpec | None = None   # None: composed of the two policies
    router: str = DEFAULT_ROUTER         # arrivals -> prefill (or colocated) instances
    #: finished prefills -> decode instances; "auto": the decode policy's own
    #: (``preferred_decode_router``: adaptive -> tpot-aware), else least-loaded
    decode_router: str = DEFAULT_DECODE_ROUTER
    #: KV capacity per instance in tokens; None derives it from the cost model's memory
    prefill_kv_tokens: int | None = None
    decode_kv_tokens: int | None = None
    #: host-memory pool per decode instance (swap, AlignedServe); 0 = none, except for a policy
    #: that needs one (AlignedServe), which gets :func:`default_host_kv_tokens`
    host_kv_tokens: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_link: str = "nvlink"              # prefill -> decode transfer link
    swap_link: str = "pcie"              # host pool <-> decode device (swap, AlignedServe prefetch)
    #: per-prefill-instance prefix cache (with ``prefill_opts={"prefix_caching": True}``): None
    #: idealises it (a request's ``prefix_len`` counts as cached wherever it runs); a number gives
    #: each prefill instance its own LRU cache of that many tokens (requests reuse only what the
    #: instance they land on prefilled before); 0 means "as large as the instance's KV capacity"
    prefix_cache_tokens: int | None = None
    prefill_opts: dict[str, Any] = field(default_factory=dict)
    decode_opts: dict[str, Any] = field(default_factory=dict)
    record_token_times: bool = False
    #: where the policies' predictors come from: "online" (learned from the instance's own step
    #: times), "oracle" (the cost model that charges the time) or "profile" (a noisy offline fit);
    #: see laneserve.policies.predictors
    predictor: str = "online"
    #: prompt + output tokens a request may need (the server's max_model_len): longer requests are
    #: rejected at arrival (finish reason "rejected") and counted, not simulated. None: the cost
    #: model's model spec's context (no limit when it has none); 0: no limit
    max_model_len: int | None = None
    #: topology, policies and routers, as every driver reads them (the cluster runtime's):
    #: computed once from the fields above
    deployment: Deployment = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        counts = (self.num_prefill, self.num_decode) if self.mode == "disaggregated" else (self.num_colocated,)
        if min(counts) < 1:
            raise ValueError(f"a {self.mode} cluster needs at least one instance of each role")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be None or >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {self.predictor!r}")
        if self.max_model_len is not None and self.max_model_len < 0:
            raise ValueError("max_model_len must be None or >= 0")
        colocated = self.mode == "colocated"
        object.__setattr__(self, "deployment", Deployment(
            mode=self.mode, num_prefill=self.num_colocated if colocated else self.num_prefill,
            num_decode=self.num_decode, prefill_policy=self.prefill_policy, decode_policy=self.decode_policy,
            colocated_policy=self.colocated_policy, router=self.router, decode_router=self.decode_router))

    def instance_specs(self) -> tuple[InstanceSpec, ...]:
        """Every instance of the run, sized: a front instance gets ``prefill_kv_tokens``, a decode
        one ``decode_kv_tokens`` (None: the cost model's memory); a decode-side instance the host
        pool ``host_kv_tokens``, or (None) the simulator's default one when its policy needs a
        host pool and none was given."""
        def sizes(role: str) -> dict[str, Any]:
            if role == "prefill":
                return {"kv_tokens": self.prefill_kv_tokens}
            spec = self.deployment.specs[0 if role == "colocated" else 1]
            host: int | None = self.host_kv_tokens
            if not host and getattr(registry.factory(role, spec.name), "needs_host_pool", False):
                host = None
            return {"kv_tokens": self.prefill_kv_tokens if role == "colocated" else self.decode_kv_tokens,
                    "host_kv_tokens": host}
        return self.deployment.instance_specs(sizes)

    def describe(self) -> str:
        return self.deployment.describe()


def kv_capacity_tokens(cost_model: Any, utilization: float) -> int:
    """KV tokens that fit on one instance: memory left after the weights (per tensor-parallel
    group), at ``utilization``. Falls back to a large default when the model says nothing."""
    fn = getattr(cost_model, "kv_capacity_tokens", None)
    if callable(fn):
        return int(fn(utilization))
    return 1 << 20


def default_host_kv_tokens(cost_model: Any) -> int:
    """The host KV pool of a decode instance whose policy needs one and was given none: the KV
    tokens that fit :data:`HOST_BYTES_PER_GPU` per GPU of the instance (``tp`` GPUs)."""
    per_token = getattr(cost_model, "kv_bytes_per_token", 0)
    if not per_token:
        return 1 << 22
    return int(HOST_BYTES_PER_GPU * getattr(cost_model, "tp", 1) / per_token)


def context_limit(config: ClusterConfig, cost_model: Any) -> int | None:
    """The prompt + output tokens a request may need on this run (None: no limit)."""
    if config.max_model_len is not None:
        return config.max_model_len or None
    spec = getattr(cost_model, "model", None)
    return getattr(spec, "max_context", None)


def decode_router_name(config: ClusterConfig) -> str | None:
    """The decode router a run uses: ``config.decode_router``, with "auto" resolved."""
    return config.deployment.decode_router_name()
