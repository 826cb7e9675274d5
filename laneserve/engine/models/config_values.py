"""What every model family's config reader shares (``config.py`` and the per-family readers such as
``opt_config.py`` import it, so neither imports the other back): the error for a checkpoint the
engine cannot run, and token-id lists read from a config value."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented by the engine."""


def as_ids(value: object) -> list[int]:
    """A config's token id(s) (None, one id or a list) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]
