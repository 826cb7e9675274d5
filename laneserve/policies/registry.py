"""Registries of interchangeable policies, selectable by name with options.

A policy spec is ``name`` or ``name:key=value,key=value`` (for example ``cp-edf:chunk=2048``);
values are parsed as int, float, bool or left as strings. Aliases let a spec name a preset
(``cp-edf-2k``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTRIES: dict[str, dict[str, Callable[..., Any]]] = {"prefill": {}, "decode": {}, "colocated": {},
                                                         "router": {}}
_ALIASES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {k: {} for k in _REGISTRIES}


def register(kind: str, name: str, *, aliases: dict[str, dict[str, Any]] | None = None):
    """Decorator: register a factory (usually a class) under ``kind``/``name``."""
    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRIES[kind][name] = factory
        for alias, opts in (aliases or {}).items():
            _ALIASES[kind][alias] = (name, opts)
        return factory
    return deco


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.strip().partition(":")
    opts: dict[str, Any] = {}
    if rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"bad policy option {item!r} in {spec!r}: expected key=value")
            opts[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return name.strip().lower(), opts


def available(kind: str) -> list[str]:
    _ensure_loaded()
    return sorted([*_REGISTRIES[kind], *_ALIASES[kind]])


def resolve(kind: str, spec: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The factory and options a spec names; ValueError listing valid names otherwise."""
    _ensure_loaded()
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown policy kind {kind!r}; expected one of {sorted(_REGISTRIES)}")
    name, opts = parse_spec(spec)
    if name in _ALIASES[kind]:
        base, preset = _ALIASES[kind][name]
        name, opts = base, {**preset, **opts}
    factory = _REGISTRIES[kind].get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} policy {name!r}; available: {', '.join(available(kind))}")
    return factory, opts


def make(kind: str, spec: str, *args: Any, **defaults: Any) -> Any:
    """Build the policy a spec names; spec options override ``defaults``."""
    factory, opts = resolve(kind, spec)
    try:
        return factory(*args, **{**defaults, **opts})
    except TypeError as exc:
        raise ValueError(f"bad options for {kind} policy {spec!r}: {exc}") from exc


def _ensure_loaded() -> None:
    # Importing the policy packages runs their @register decorators.
    import laneserve.policies.decode  # noqa: F401
    import laneserve.policies.prefill  # noqa: F401
    import laneserve.policies.colocated  # noqa: F401
    import laneserve.policies.routing  # noqa: F401
    import laneserve.policies.routing_laps  # noqa: F401
