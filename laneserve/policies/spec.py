"""Typed policy specs: a policy named once, its options read and checked once where it enters (the
CLI, a deployment, ``LLM``), then carried as a value. The text form (``cp-edf:chunk=512``) is only
the CLI's syntax; a colocated pair is two specs, never one string split again on commas (an option
of the decode spec would land on the prefill side). Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One policy: its registry ``kind`` and ``name`` (aliases resolved), its typed ``options``
    (defaults filled in) and which of them were ``given`` (only those override a driver's defaults)."""

    kind: str
    name: str
    options: Any
    given: tuple[str, ...] = ()

    @classmethod
    def parse(cls, kind: str, text: str) -> PolicySpec:
        """The spec CLI text names; ValueError naming the bad option or listing the valid names."""
        from laneserve.policies import registry
        factory, opts = registry.resolve(kind, text)
        own = {f.name for f in fields(factory.Options)}
        forwarded = {k: v for k, v in opts.items() if k not in own}
        inner = getattr(factory, "forwards_options_to", None)
        opts = {k: v for k, v in opts.items() if k in own}
        if forwarded and inner:      # options of the inner policy (colocated: its prefill side) go into its spec
            base = as_spec(inner, opts.get(inner, getattr(factory.Options(), inner)))
            opts[inner] = cls(inner, base.name, replace(base.options, **forwarded),
                              tuple(sorted({*base.given, *forwarded})))
        return cls(kind, registry.canonical_name(kind, text), factory.Options(**opts), tuple(sorted(opts)))

    def given_options(self) -> dict[str, Any]:
        return {k: getattr(self.options, k) for k in self.given if hasattr(self.options, k)}

    def describe(self) -> dict[str, Any]:
        """The options in force, nested specs (a colocated pair's halves) described too: for
        ``/debug/state``."""
        out: dict[str, Any] = {}
        for f in fields(self.options):
            value = getattr(self.options, f.name)
            out[f.name] = value.describe() if isinstance(value, PolicySpec) else value
        return {"kind": self.kind, "name": self.name, "options": out}

    def __str__(self) -> str:
        """The CLI text of this spec (a nested spec in square brackets, so it reads back the same)."""
        from laneserve.policies.registry import nested
        opts = ",".join(f"{k}={nested(str(v)) if isinstance(v, PolicySpec) else v}"
                        for k, v in self.given_options().items())
        return f"{self.name}:{opts}" if opts else self.name

    # ---- across a process boundary (JSON spawn arguments) ----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "given": list(self.given),
                "options": {k: v.to_dict() if isinstance(v, PolicySpec) else v
                            for k, v in self.given_options().items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicySpec:
        from laneserve.policies import registry
        factory = registry.factory(d["kind"], d["name"])
        opts = {k: cls.from_dict(v) if isinstance(v, dict) else v for k, v in d["options"].items()}
        return cls(d["kind"], d["name"], factory.Options(**opts), tuple(d["given"]))


def colocated_spec(prefill: PolicySpec, decode: PolicySpec, **own: Any) -> PolicySpec:
    """The colocated policy composed of two already-resolved specs (``own``: its own options,
    e.g. ``token_budget``)."""
    from laneserve.policies import registry
    factory = registry.factory("colocated", "colocated")
    opts = {"prefill": prefill, "decode": decode, **own}
    return PolicySpec("colocated", "colocated", factory.Options(**opts), tuple(sorted(opts)))


def as_spec(kind: str, policy: str | PolicySpec) -> PolicySpec:
    return policy if isinstance(policy, PolicySpec) else PolicySpec.parse(kind, policy)
