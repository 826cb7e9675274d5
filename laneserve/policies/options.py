"""Policy options as frozen, typed dataclasses.

Every policy class declares ``Options``, a ``@dataclass(frozen=True, slots=True)`` subclass of
:class:`PolicyOptions` whose fields are the policy's tunable options with their defaults. A policy
extends its parent's options by inheritance (``PrefillOptions -> SEDFOptions``); a policy
composed from another's mechanisms rather than derived from it declares the fields it uses itself
(``AdaptivePrefillOptions`` extends ``PrefillOptions`` with S-EDF's fields and its own). Runtime objects (KV manager, host pool, cost model, predictor, LUT) are
not options: they stay constructor arguments.

Constructing an options value checks every field against its annotation (``int``, ``float``,
``bool``, ``str``, ``Literal[...]`` choices, unions such as ``float | None``; an ``int`` given for a
``float`` becomes a float) and then runs :meth:`PolicyOptions.validate`, where a class checks its
own fields (calling its parent's ``validate`` first). Every error is a ``ValueError`` naming the
field. The pattern, for a policy ``Foo`` under ``Parent``::

    @dataclass(frozen=True, slots=True)
    class FooOptions(ParentOptions):
        chunk: int = 2048
        order: Literal["descending", "ascending"] = "descending"

        def validate(self) -> None:
            ParentOptions.validate(self)
            at_least(self, "chunk", 1)

    class Foo(Parent):
        Options = FooOptions

        def __init__(self, kv, options: FooOptions | None = None, *, cost_model=None, **opts):
            super().__init__(kv, options, **opts)      # the root builds self.options (a FooOptions)
            self.chunk_size = self.options.chunk

The root of the hierarchy builds ``self.options`` once, from ``type(self).Options``, with
:func:`build_options`: keyword options (``Foo(kv, chunk=4096)``), an ``Options`` value
(``Foo(kv, FooOptions(chunk=4096))``), or both (keywords replace fields of the value). A subclass
that declares no ``Options`` of its own and takes its options as keywords (``**opts`` passed up)
keeps working: it gets its parent's ``Options``.

Dataclasses with ``slots=True`` do not support zero-argument ``super()`` on Python 3.11, hence the
explicit ``ParentOptions.validate(self)``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from numbers import Integral, Real
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

OptionsT = TypeVar("OptionsT", bound="PolicyOptions")


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Base of every policy's options (no fields of its own)."""

    def __post_init__(self) -> None:
        hints = option_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = check_value(f.name, value, hints[f.name])
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        self.validate()

    def validate(self) -> None:
        """Check the values of this class's own fields. Subclasses call their parent's first, or
        right after filling a default derived from their own fields (:func:`default_to`)."""


# ---- helpers for validate() ---------------------------------------------------------------------
def option_error(name: str, message: str, value: Any) -> ValueError:
    return ValueError(f"option {name} {message}, got {value!r}")


def at_least(opts: PolicyOptions, name: str, low: float) -> None:
    value = getattr(opts, name)
    if value is not None and value < low:
        raise option_error(name, f"must be >= {low}", value)


def above(opts: PolicyOptions, name: str, low: float) -> None:
    value = getattr(opts, name)
    if value is not None and not value > low:
        raise option_error(name, f"must be > {low}", value)


def default_to(opts: PolicyOptions, name: str, source: str) -> None:
    """A field left ``None`` takes the value of field ``source`` (CP-EDF's budget is its chunk)."""
    if getattr(opts, name) is None:
        object.__setattr__(opts, name, getattr(opts, source))


def within(opts: PolicyOptions, name: str, low: float, high: float) -> None:
    """``low <= value <= high``."""
    value = getattr(opts, name)
    if value is not None and not low <= value <= high:
        raise option_error(name, f"must be in [{low}, {high}]", value)


# ---- types --------------------------------------------------------------------------------------
@cache
def option_hints(cls: type) -> dict[str, Any]:
    """The evaluated annotation of every field of an options class."""
    return typing.get_type_hints(cls)


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def type_name(hint: Any) -> str:
    """How a field's type reads in errors and listings (``int``, ``float | None``, ``a|b``)."""
    if get_origin(hint) is Literal:
        return "|".join(str(a) for a in get_args(hint))
    if _is_union(hint):
        return " | ".join(type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _accepts(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` is of type ``hint``, and the value to store (an int given for a float
    becomes a float)."""
    if hint is Any:
        return True, value
    if _is_union(hint):
        for member in get_args(hint):
            ok, stored = _accepts(value, member)
            if ok:
                return True, stored
        return False, value
    if get_origin(hint) is Literal:
        return value in get_args(hint), value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        ok = isinstance(value, Integral) and not isinstance(value, bool)
        return ok, int(value) if ok and type(value) is not int else value
    if hint is float:
        ok = isinstance(value, Real) and not isinstance(value, bool)
        return ok, float(value) if ok and type(value) is not float else value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value                # a generic we do not check (tuple[int, ...]...)


def check_value(name: str, value: Any, hint: Any) -> Any:
    """``value`` as stored in field ``name`` of type ``hint``; ValueError naming the field otherwise."""
    ok, stored = _accepts(value, hint)
    if ok:
        return stored
    if get_origin(hint) is Literal:
        choices = ", ".join(str(a) for a in get_args(hint))
        raise option_error(name, f"must be one of {choices}", value)
    raise option_error(name, f"expects {type_name(hint)}", value)


def _readings(text: str) -> Iterable[Any]:
    """The values a spec's text may stand for, most specific first (``none`` may be None)."""
    if text.lower() in ("none", "null"):
        yield None
    yield from scalar_readings(text)


def scalar_readings(text: str) -> Iterable[Any]:
    """bool, int, float, then the text itself: the readings of a value whose type is not known."""
    low = text.lower()
    if low in ("true", "false"):
        yield low == "true"
    for conv in (int, float):
        try:
            yield conv(text)
        except ValueError:
            pass
    yield text


def parse_option(cls: type[PolicyOptions], name: str, text: str) -> Any:
    """The value of option ``name`` of ``cls`` that a spec's ``text`` gives (``chunk=2048``: the
    int 2048; ``chunk=abc``: a ValueError naming ``chunk``); the first reading the field's type
    accepts. An unknown ``name`` is a ValueError listing the valid options."""
    if name not in option_defaults(cls):
        raise unknown_options_error(cls, [name])
    hint = option_hints(cls)[name]
    for candidate in _readings(text):
        ok, stored = _accepts(candidate, hint)
        if ok:
            return stored
    return check_value(name, text, hint)      # raises: no reading fits


# ---- building and listing -----------------------------------------------------------------------
def option_defaults(cls: type[PolicyOptions]) -> dict[str, Any]:
    """Field name -> default, in declaration order (parents' fields first)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def format_options(cls: type[PolicyOptions], *, typed: bool = False) -> str:
    """``name=default`` (``typed``: ``name: type = default``) for every option of ``cls``
    ("no options" when it has none)."""
    defaults = option_defaults(cls)
    hints = option_hints(cls)
    return ", ".join(f"{k}: {type_name(hints[k])} = {v}" if typed else f"{k}={v}"
                     for k, v in defaults.items()) or "no options"


def unknown_options_error(cls: type[PolicyOptions], unknown: Iterable[str]) -> ValueError:
    names = ", ".join(repr(k) for k in sorted(unknown))
    return ValueError(f"unknown option {names}; valid options (defaults): {format_options(cls)}")


def build_options(cls: type[OptionsT], options: OptionsT | None, overrides: Mapping[str, Any]) -> OptionsT:
    """The options a policy runs with: ``options`` (an instance of ``cls``, or None for the
    defaults) with the keyword ``overrides`` applied."""
    unknown = set(overrides) - option_defaults(cls).keys()
    if unknown:
        raise unknown_options_error(cls, unknown)
    if options is None:
        return cls(**overrides)
    if not isinstance(options, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options
