"""The piecewise JSON encoder of large response bodies: the same bytes as one ``json.dumps``,
and a chance for other threads (the event loop) after every ``YIELD_BYTES`` of output."""

from __future__ import annotations

import json

import pytest

from laneserve.server import encode
from laneserve.server.encode import encode_json


def _reference(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("obj", [
    {}, [], {"a": []}, [[]], "x", 1.5, None,
    {"a": [1, 2, {"b": [None, 1.5, "é\u2028\"\\"]}], "c": {}, "d": [], "e": [[1, 2], [3]] * 100},
    {"choices": [{"index": i, "logprobs": {"tokens": [f"t{j}" for j in range(500)],
                                           "top_logprobs": [{"a": -0.5, "b": -1.0}] * 500}} for i in range(9)]},
    [[[[[[[[1]]]]]]]], [{"x": i} for i in range(300)],
])
def test_same_bytes_as_one_dumps(obj):
    assert encode_json(obj) == _reference(obj)


def test_nan_is_refused_as_json_dumps_does():
    with pytest.raises(ValueError):
        encode_json({"a": [float("nan")]})


def test_large_bodies_let_other_threads_run(monkeypatch):
    yields = []
    monkeypatch.setattr(encode.time, "sleep", lambda s: yields.append(s))
    body = {"choices": [{"logprobs": {"top_logprobs": [{f"k{j}": -1.25 for j in range(20)} for _ in range(5000)]}}
                        for _ in range(4)]}
    out = encode_json(body)
    assert out == _reference(body)
    assert len(yields) >= len(out) // (2 * encode.YIELD_BYTES) > 10     # pieces are smaller than YIELD_BYTES
