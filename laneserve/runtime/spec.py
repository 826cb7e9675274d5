"""The typed specs a deployment is built from. A policy spec lives with the policies (their
options types are its options) and is re-exported here; an :class:`InstanceSpec` is one instance:
its role, its resolved policy (a colocated instance: the colocated policy holding its two typed
halves), and the sizes every driver reads the same way. The entry points (the CLI, a
``ClusterConfig``, a ``ClusterSpec``, ``LLM``, the planner) produce them once;
:func:`~laneserve.runtime.build.build_instance` builds an instance from one. What an instance
runs on (a cost model or an executor, a clock, a KV link, a rank group) is not in the spec: each
driver supplies it. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laneserve.policies.spec import PolicySpec, as_spec, colocated_spec

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance. ``kv_tokens``: its device KV capacity (None: the driver sizes it from the
    device's memory); ``host_kv_tokens``: its host KV pool (0: none; None: a pool of the driver's
    default size, for a policy that needs one); ``token_budget``: tokens per colocated step (None:
    the policy's own); ``tensor_parallel_size``: the ranks it is sharded over."""

    role: str
    policy: PolicySpec
    kv_tokens: int | None = None
    host_kv_tokens: int | None = 0
    token_budget: int | None = None
    device: str = "cpu"
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"instance role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.policy, PolicySpec) or self.policy.kind != self.role:
            raise ValueError(f"a {self.role} instance needs a {self.role} policy spec, got {self.policy!r}")
        for name in ("kv_tokens", "token_budget"):
            _check_count(name, getattr(self, name), minimum=1, optional=True)
        _check_count("host_kv_tokens", self.host_kv_tokens, minimum=0, optional=True)
        _check_count("tensor_parallel_size", self.tensor_parallel_size, minimum=1, optional=False)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")

    @classmethod
    def of(cls, role: str, policy: str | PolicySpec, **sizes: Any) -> InstanceSpec:
        """The spec of a ``role`` instance running ``policy`` (CLI text read once here)."""
        if role not in ROLES:
            raise ValueError(f"instance role must be one of {', '.join(ROLES)}, got {role!r}")
        return cls(role, as_spec(role, policy), **sizes)

    # ---- across a process boundary (a worker's spawn arguments) ------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {**_fields(self), "policy": self.policy.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceSpec:
        return cls(**{**d, "policy": PolicySpec.from_dict(d["policy"])})


def _fields(spec: InstanceSpec) -> dict[str, Any]:
    """The spec's fields, values as they are (``dataclasses.asdict`` would convert the policy's)."""
    return {name: getattr(spec, name) for name in InstanceSpec.__dataclass_fields__}


def _check_count(name: str, value: Any, *, minimum: int, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}")


__all__ = ["ROLES", "InstanceSpec", "PolicySpec", "as_spec", "colocated_spec"]
