"""Registries of interchangeable policies, selectable by name with options.

A policy spec is ``name`` or ``name:key=value,key=value`` (for example ``cp-edf:chunk=2048``).
A policy class that declares its typed ``Options`` (:mod:`laneserve.policies.options`) has its spec
read and checked through them: each value is parsed as its field's type, an unknown key is an
error listing the valid options with their defaults, and the merged options are validated before
anything is built. Aliases name presets (``cp-edf-2k`` is ``cp-edf`` with ``chunk=2048``), checked
against the same ``Options`` when registered. A class naming ``forwards_options_to`` (colocated:
``"prefill"``) has the spec options that are not its own read as options of the inner policy its
option of that name gives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from laneserve.policies.options import (PolicyOptions, format_options, option_defaults,
                                        parse_option, scalar_readings, unknown_options_error)

_REGISTRIES: dict[str, dict[str, Callable[..., Any]]] = {"prefill": {}, "decode": {}, "colocated": {},
                                                         "router": {}}
_ALIASES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {k: {} for k in _REGISTRIES}


def register(kind: str, name: str, *, aliases: dict[str, dict[str, Any]] | None = None):
    """Decorator: register a factory (usually a class) under ``kind``/``name``."""
    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        declared = getattr(factory, "Options", None)
        if not (isinstance(declared, type) and issubclass(declared, PolicyOptions)):
            raise TypeError(f"{kind} policy {name!r}: {factory!r} has no Options (a PolicyOptions dataclass)")
        for alias, opts in (aliases or {}).items():
            _checked(declared, opts, f"preset {alias!r} of {kind} policy {name!r}")
        _REGISTRIES[kind][name] = factory
        for alias, opts in (aliases or {}).items():
            _ALIASES[kind][alias] = (name, opts)
        return factory
    return deco




def split_top_level(text: str, sep: str = ",") -> list[str]:
    """``text`` split at each ``sep`` outside square brackets: ``a=[x:k=1,j=2],b=y`` is two items."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == sep and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    items.append(text[start:])
    return items


def nested(spec: str) -> str:
    """``spec`` as an option value of another spec: in square brackets when it has options, so its
    commas stay its own (``colocated:prefill=[cp-edf:chunk=512],decode=[continuous:a=1,b=2]``)."""
    return f"[{spec}]" if ":" in spec or "," in spec else spec


def _split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A spec's name and its options as written (text values; a value in square brackets, another
    policy's spec, loses its brackets and keeps its commas)."""
    name, _, rest = spec.strip().partition(":")
    opts: dict[str, str] = {}
    if rest:
        for item in split_top_level(rest):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"bad policy option {item!r} in {spec!r}: expected key=value")
            value = value.strip()
            if value.startswith("[") and value.endswith("]"):
                value = value[1:-1].strip()
            opts[key.strip().replace("-", "_")] = value
    return name.strip().lower(), opts


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A spec's name and options, values read without knowing the policy (int, float, bool, str)."""
    name, raw = _split_spec(spec)
    return name, {k: next(scalar_readings(v)) for k, v in raw.items()}


def available(kind: str) -> list[str]:
    _ensure_loaded()
    return sorted([*_REGISTRIES[kind], *_ALIASES[kind]])


def _checked(cls: type[PolicyOptions], opts: dict[str, Any], what: str) -> PolicyOptions:
    """``cls(**opts)``, with any error said to be in ``what``."""
    try:
        unknown = opts.keys() - option_defaults(cls).keys()
        if unknown:
            raise unknown_options_error(cls, unknown)
        return cls(**opts)
    except ValueError as exc:
        raise ValueError(f"bad options for {what}: {exc}") from None


def factory(kind: str, name: str) -> Callable[..., Any]:
    """The factory registered as ``name`` (an alias resolved) of ``kind``; a registered name (a
    typed spec's) is looked up as it is, not read as spec text."""
    _ensure_loaded()
    found = _REGISTRIES[kind].get(name)
    return found if found is not None else _REGISTRIES[kind][canonical_name(kind, name)]


def canonical_name(kind: str, spec: str) -> str:
    """The registered name a spec text (or a bare name) refers to, aliases resolved."""
    _ensure_loaded()
    name = _split_spec(spec)[0]
    return _ALIASES[kind][name][0] if name in _ALIASES[kind] else name


def resolve(kind: str, spec: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The factory and options a spec names; ValueError listing valid names otherwise, or (for a
    policy with typed ``Options``) naming the option that is unknown or of a wrong value. A typed
    spec (:class:`~laneserve.runtime.spec.PolicySpec`) is already checked: its given options."""
    factory, opts, what = _parse(kind, spec)
    if isinstance(spec, str):
        own = option_defaults(factory.Options).keys()
        _checked(factory.Options, {k: v for k, v in opts.items() if k in own}, what)
    return factory, opts


def _parse(kind: str, spec: Any) -> tuple[Callable[..., Any], dict[str, Any], str]:
    """The factory a spec names, its options (read as their types, presets filled in, options a
    colocated spec forwards read as its inner policy's) and how errors name it; the options are
    not built here (:func:`resolve` checks them, :func:`make` builds them once)."""
    _ensure_loaded()
    if not isinstance(spec, str):
        if spec.kind != kind:
            raise ValueError(f"a {spec.kind} policy ({spec}) given where a {kind} policy is expected")
        return _REGISTRIES[kind][spec.name], spec.given_options(), f"{kind} policy {str(spec)!r}"
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown policy kind {kind!r}; expected one of {sorted(_REGISTRIES)}")
    name, raw = _split_spec(spec)
    preset: dict[str, Any] = {}
    if name in _ALIASES[kind]:
        name, preset = _ALIASES[kind][name]
    factory = _REGISTRIES[kind].get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} policy {name!r}; available: {', '.join(available(kind))}")
    declared = factory.Options
    what = f"{kind} policy {spec!r}"
    inner = getattr(factory, "forwards_options_to", None)
    own = option_defaults(declared).keys()
    forwarded = {k: v for k, v in raw.items() if k not in own} if inner else {}
    try:
        opts = {**preset, **{k: parse_option(declared, k, v) for k, v in raw.items() if k not in forwarded}}
    except ValueError as exc:
        raise ValueError(f"bad options for {what}: {exc}") from None
    if forwarded:            # read as options of the inner policy (colocated: its prefill policy)
        inner_spec = opts.get(inner, option_defaults(declared)[inner])
        inner_spec = inner_spec if isinstance(inner_spec, str) else str(inner_spec)
        sep = "," if ":" in inner_spec else ":"
        try:
            _, inner_opts = resolve(inner, inner_spec + sep + ",".join(f"{k}={v}" for k, v in forwarded.items()))
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        opts.update((k, inner_opts[k]) for k in forwarded)
    return factory, opts, what


def options(kind: str, spec: Any) -> PolicyOptions:
    """The typed options a spec gives its policy (presets and defaults filled in; options it
    forwards to an inner policy left out)."""
    factory, opts, what = _parse(kind, spec)
    own = option_defaults(factory.Options).keys()
    return _checked(factory.Options, {k: v for k, v in opts.items() if k in own}, what)


def make(kind: str, spec: Any, *args: Any, **defaults: Any) -> Any:
    """Build the policy a spec names; spec options override ``defaults``. Its typed options are
    built once, from both (the keywords that are not options, a host pool or a predictor, and
    options a colocated spec forwards to its inner policy, are passed on as keywords)."""
    factory, opts, what = _parse(kind, spec)
    merged = {**defaults, **opts}
    own = option_defaults(factory.Options).keys()
    built = _checked(factory.Options, {k: v for k, v in merged.items() if k in own}, what)
    try:
        return factory(*args, options=built, **{k: v for k, v in merged.items() if k not in own})
    except TypeError as exc:
        raise ValueError(f"bad options for {kind} policy {spec!r}: {exc}") from exc


def decode_router_for(decode_policy: str, decode_router: str = "auto") -> str:
    """The decode router to use: ``decode_router``, or with "auto" the decode policy's own
    (``preferred_decode_router``: ``tpot-aware`` for adaptive decode), else least-loaded."""
    if decode_router != "auto":
        return decode_router
    policy = resolve("decode", decode_policy)[0]
    return getattr(policy, "preferred_decode_router", None) or "least-loaded"


def describe(kind: str) -> list[str]:
    """One line per registered ``kind`` policy: its name, its options with their defaults, and
    its presets (aliases) with the options each sets."""
    _ensure_loaded()
    lines = []
    for name, factory in sorted(_REGISTRIES[kind].items()):
        opts = format_options(factory.Options, typed=True)
        presets = [f"{alias}" + (f" ({', '.join(f'{k}={v}' for k, v in preset.items())})" if preset else "")
                   for alias, (base, preset) in sorted(_ALIASES[kind].items()) if base == name]
        inner = getattr(factory, "forwards_options_to", None)
        if inner:
            opts += f"; other options go to its {inner} policy"
        lines.append(f"{name}: {opts}" + (f"; presets: {', '.join(presets)}" if presets else ""))
    return lines


# The modules whose import registers the policies (their ``@register`` decorators run then). Named,
# not imported, so the registry never imports its policies back: each policy module imports the
# registry, the registry loads this table on the first lookup.
POLICY_MODULES = (
    "laneserve.policies.decode",
    "laneserve.policies.prefill",
    "laneserve.policies.colocated",
    "laneserve.policies.routing",
    "laneserve.policies.routing_laps",
    "laneserve.policies.routing_tpot",
)


def _ensure_loaded() -> None:
    for module in POLICY_MODULES:
        importlib.import_module(module)
