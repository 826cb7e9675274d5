"""JSON encoding of large response bodies that never holds the interpreter for long.

``json.dumps`` encodes a whole object in one C call while holding the GIL: a 20 MB body (echo
with logprobs over many choices, prompt logprobs of a batch) takes a second or more, and for that
second the event loop cannot answer anything, ``/health`` included, even though the encoding runs
in a worker thread. :func:`encode_json` walks the top levels of the object itself, encodes the
pieces (a list's items in small batches) with ``json.dumps`` and lets other threads run (a
``time.sleep(0)``) after every ``yield_bytes`` of output, so the loop waits at most one piece.
The bytes are the same as ``json.dumps(obj, ensure_ascii=False, allow_nan=False,
separators=(",", ":"))`` gives.
"""

from __future__ import annotations

import json
import time
from typing import Any

BATCH_ITEMS = 64            # list items encoded per json.dumps call
YIELD_BYTES = 64 << 10      # output between two chances for other threads to run
WALK_DEPTH = 6              # containers deeper than this are encoded whole (they are small pieces)

_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


class _Out:
    __slots__ = ("parts", "since")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.since = 0

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.since += len(text)
        if self.since >= YIELD_BYTES:
            self.since = 0
            time.sleep(0)               # let the event loop's thread take the GIL


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON, encoded in pieces (see the module docstring)."""
    out = _Out()
    _walk(obj, out, 0)
    return "".join(out.parts).encode()


def _walk(v: Any, out: _Out, depth: int) -> None:
    if depth >= WALK_DEPTH or not isinstance(v, (dict, list)) or not v:
        out.add(_dumps(v))
    elif isinstance(v, dict):
        out.add("{")
        for i, (k, val) in enumerate(v.items()):
            out.add(("," if i else "") + _dumps(k if isinstance(k, str) else str(k)) + ":")
            _walk(val, out, depth + 1)
        out.add("}")
    elif isinstance(v[0], (dict, list)) and len(v) <= BATCH_ITEMS:
        out.add("[")
        for i, item in enumerate(v):
            if i:
                out.add(",")
            _walk(item, out, depth + 1)
        out.add("]")
    else:
        out.add("[")
        for start in range(0, len(v), BATCH_ITEMS):
            out.add(("," if start else "") + _dumps(v[start:start + BATCH_ITEMS])[1:-1])
        out.add("]")
