"""argparse value types shared by the commands: numbers checked when the command line is read."""

from __future__ import annotations

import argparse


def at_least(low: float, kind=int):
    """A type for numbers (``kind``) of at least ``low``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {text}")
        return value
    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
