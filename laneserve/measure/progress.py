"""Progress bars for sweeps and long simulations: tqdm on stderr, quiet where nobody watches.

A bar is shown when ``enabled`` is True, or — when it is None — when stderr is a terminal.
Under CI (``CI`` set to a true value) nothing is ever printed, whatever ``enabled`` says, so that
logs stay clean. tqdm is imported only when a bar is actually shown.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def progress_enabled(enabled: bool | None = None) -> bool:
    """Whether a bar would be shown: never in CI; else ``enabled``, defaulting to stderr being a TTY."""
    if in_ci():
        return False
    if enabled is not None:
        return enabled
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress(iterable: Iterable[T], total: int | None = None, desc: str | None = None,
             enabled: bool | None = None, **tqdm_kwargs: Any) -> Iterable[T]:
    """``iterable`` wrapped in a tqdm bar on stderr, or returned unchanged when disabled."""
    if not progress_enabled(enabled):
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                **tqdm_kwargs)


class _NullBar:
    """Stands in for a tqdm bar when progress is off."""

    n = 0

    def update(self, n: float = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __enter__(self) -> _NullBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(())


def progress_bar(total: float | None = None, desc: str | None = None,
                 enabled: bool | None = None, **tqdm_kwargs: Any) -> Any:
    """A manually updated bar (e.g. simulated seconds): tqdm or a no-op with the same methods."""
    if not progress_enabled(enabled):
        return _NullBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, **tqdm_kwargs)
