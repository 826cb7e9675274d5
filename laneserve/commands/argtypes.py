"""argparse value types shared by the commands: numbers and paths checked when the command line is
read, so a bad value is one line from argparse (exit 2), never a traceback from deep inside a run.

Every number is finite unless a type says otherwise (``nan`` and ``inf`` are refused), and lies in
the range its flag names. Sizes that would make a run take hours before it reports anything (a
prompt of a billion tokens, a GPU budget of a hundred thousand) are bounded by the limits below,
stated in the error.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

#: the longest prompt or output (tokens) a command generates or reads from a trace
MAX_TOKENS = 10_000_000
#: the most GPUs a plan considers (``--budget``, ``--max-gpus``)
MAX_GPUS = 1024
#: the most requests, sessions or simulated layouts one command runs
MAX_COUNT = 10_000_000


def _kind_name(kind) -> str:
    return "an integer" if kind is int else "a number"


def number(kind=float, *, low: float | None = None, high: float | None = None, low_open: bool = False,
           allow_inf: bool = False) -> Callable[[str], float]:
    """A type for a finite number (``kind``) in [``low``, ``high``] (``low_open``: above ``low``);
    ``allow_inf`` lets ``inf`` through (a rate meaning "all at once")."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {_kind_name(kind)}, got {text!r}") from None
        if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {'above' if low_open else 'at least'} {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text}")
        return value
    return parse


def at_least(low: float, kind=int, high: float | None = None) -> Callable[[str], float]:
    """A type for finite numbers (``kind``) of at least ``low`` (and at most ``high``)."""
    return number(kind, low=low, high=high)


def positive(kind=float, high: float | None = None) -> Callable[[str], float]:
    """A finite number above 0."""
    return number(kind, low=0, low_open=True, high=high)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return number(float, low=0, low_open=True, high=1)(text)


def number_list(kind=int, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                allow_inf: bool = False) -> Callable[[str], list]:
    """A comma-separated list of at least one number, each checked as :func:`number` checks it."""
    one = number(kind, low=low, high=high, low_open=low_open, allow_inf=allow_inf)

    def parse(text: str) -> list:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}")
        out = []
        for part in parts:
            try:
                out.append(one(part))
            except argparse.ArgumentTypeError as exc:
                if len(parts) == 1:
                    raise
                raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: {exc}") from None
        return out
    return parse


def output_folder(text: str) -> Path:
    """A folder to write into: it may not exist yet, but must not be a file (nor lie under one)."""
    path = Path(text)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"lies under {p}, a file"
                raise argparse.ArgumentTypeError(f"{text!r} {what}, not a folder")
            break
    return path


def output_file(text: str) -> Path:
    """A file to write: not a folder, and its folder not a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    output_folder(str(path.parent))
    return path


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(text)
        parts.port    # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL with a host, got {text!r}")
    return text


def existing_file(text: str) -> Path:
    """A file to read: it must exist and not be a folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return path
