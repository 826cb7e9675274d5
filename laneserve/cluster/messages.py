"""Messages between the API/router process and the instance processes, over
ZeroMQ as compact msgpack maps.

Every message is one msgpack map with a short kind ``k``. Router -> instance:

- ``add``      a new request for a prefill (or colocated) instance: :func:`request_fields`; with
  ``sp.n`` > 1 also ``kids``, the request ids of samples 1..n-1 (sample 0 keeps ``rid``)
- ``transfer`` a prefilled request for a decode instance: request fields + ``out`` (tokens so far),
  ``computed`` (KV tokens), ``t_first`` (first-token time) and ``kv`` (a transport descriptor);
  for an n-sample request ``samples`` = ``[[rid, index, first_token], ...]``, the samples still
  wanted, which all start from the one transferred prompt KV
- ``abort``    ``rids``: drop these requests wherever they are on the instance and free their KV
- ``lane``     ``lane``: the length lane a pool router (``laps-pools``) gave this instance
- ``stop``     shut down

Instance -> router (every message carries ``inst``, the instance id):

- ``ready``    the model is loaded; ``info`` = limits the API validates against
- ``tok``      ``items`` = ``[[rid, new_token_ids, finish_reason|None, logprobs|None, info|None], ...]``
  (one message per engine step, so one per batch rather than one per token)
- ``handoff``  a prefill finished: ``rid``, ``out``, ``computed``, ``kv``, ``t_first``, ``lp``, ``info``;
  for an n-sample request also ``samples`` = ``[[rid, index, first_token, finish|None, logprobs|None], ...]``
- ``stats``    load figures for routers, metrics and admission control (``added`` = ADDs
  processed, so the router can add what it sent after the snapshot); ``kv_events`` = the prefix
  cache's block names added and dropped since the last stats (``core/prefix_summary.py``)
- ``err``      ``rids`` failed on the instance; ``msg`` says why

Times are seconds on one epoch shared by all processes (:class:`EpochClock`): ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from laneserve.core.request import Request
from laneserve.core.sampling import INT64_MAX, INT64_MIN, SamplingParams, is_int, is_real
from laneserve.core.slo import SLO
from laneserve.core.structured import StructuredSpec

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                    "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias", "min_tokens", "structured", "n", "prompt_logprobs", "min_p",
                    "allowed_token_ids", "bad_words_ids")


class EpochClock:
    """Wall time in seconds since a shared ``epoch`` (a ``time.perf_counter()`` value)."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: float | None = None) -> None:
        self.epoch = time.perf_counter() if epoch is None else epoch

    def now(self) -> float:
        return time.perf_counter() - self.epoch


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    d = {f: getattr(p, f) for f in _SAMPLING_FIELDS}
    d["stop_token_ids"] = list(p.stop_token_ids)
    d["stop"] = list(p.stop)
    d["allowed_token_ids"] = list(p.allowed_token_ids)
    d["bad_words_ids"] = [list(w) for w in p.bad_words_ids]
    d["logit_bias"] = [list(e) for e in p.logit_bias]
    d["structured"] = None if p.structured is None else [p.structured.kind, p.structured.value]
    return d


def sampling_from_dict(d: Any) -> SamplingParams:
    """The :class:`SamplingParams` of a message's ``sp`` map; ``ValueError`` on any bad field."""
    if not isinstance(d, dict):
        raise ValueError(f"sampling parameters must be a map, got {type(d).__name__}")
    fields = {k: v for k, v in d.items() if k in _SAMPLING_FIELDS}
    for name in ("stop_token_ids", "stop", "allowed_token_ids"):
        v = fields.get(name)
        if v is not None and not isinstance(v, (list, tuple)):
            raise ValueError(f"sampling '{name}' must be a list, got {type(v).__name__}")
        fields[name] = tuple(v or ())
    words = fields.get("bad_words_ids")
    if words is not None:
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) for w in words):
            raise ValueError("sampling 'bad_words_ids' must be a list of token-id lists")
        fields["bad_words_ids"] = tuple(tuple(w) for w in words)
    bias = fields.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, (list, tuple)) or not all(isinstance(e, (list, tuple)) for e in bias):
            raise ValueError("sampling 'logit_bias' must be a list of [token id, bias] pairs")
        fields["logit_bias"] = tuple(tuple(e) for e in bias)
    spec = fields.get("structured")
    if spec is not None:
        if not isinstance(spec, (list, tuple)) or len(spec) != 2:
            raise ValueError("sampling 'structured' must be a [kind, value] pair")
        fields["structured"] = StructuredSpec(*spec)     # UnsupportedSpec is a ValueError
    return SamplingParams(**fields)     # SamplingParams checks types, ranges and finiteness


def request_fields(rid: int, prompt_ids: list[int], sampling: SamplingParams, arrival: float,
                   slo: SLO, slo_class: str = "default", priority: int = 0) -> dict[str, Any]:
    return {"rid": rid, "prompt": prompt_ids, "sp": sampling_to_dict(sampling), "arrival": arrival,
            "slo": [slo.ttft, slo.tpot], "cls": slo_class, "prio": priority}


def _token_ids(v: Any, name: str, vocab_size: int | None) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(is_int(t) and t >= 0 for t in v):
        raise ValueError(f"'{name}' must be a list of token ids")
    if vocab_size is not None and any(t >= vocab_size for t in v):
        raise ValueError(f"'{name}' holds a token id outside the vocabulary [0, {vocab_size})")
    return list(v)


def _number(v: Any, name: str) -> float:
    if not is_real(v):
        raise ValueError(f"'{name}' must be a finite number, got {v!r}")
    return float(v)


def request_from_fields(m: dict[str, Any], vocab_size: int | None = None) -> Request:
    """The engine-side :class:`Request` of an ``add`` or ``transfer`` message. Raises ``ValueError``
    (and nothing else) on a malformed message, naming the field, so an instance can fail that one
    request (``m.get("rid")``) instead of the process. ``vocab_size``, when given, bounds the token
    ids (an out-of-range id would index past the embedding table)."""
    try:
        return _request_from_fields(m, vocab_size)
    except ValueError:
        raise
    except (TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise ValueError(f"malformed request message: {type(exc).__name__}: {exc}") from None


def _request_from_fields(m: dict[str, Any], vocab_size: int | None) -> Request:
    rid = m["rid"]
    if not is_int(rid):
        raise ValueError(f"'rid' must be an integer, got {rid!r}")
    sampling = sampling_from_dict(m["sp"])
    prompt = _token_ids(m["prompt"], "prompt", vocab_size)
    if vocab_size is not None and any(t >= vocab_size for t, _ in sampling.logit_bias):
        raise ValueError(f"'logit_bias' holds a token id outside the vocabulary [0, {vocab_size})")
    slo = m["slo"]
    if not isinstance(slo, (list, tuple)) or len(slo) != 2:
        raise ValueError(f"'slo' must be [ttft, tpot], got {slo!r}")
    ttft, tpot = (None if v is None else _number(v, "slo") for v in slo)
    cls, prio = m.get("cls", "default"), m.get("prio", 0)
    if not isinstance(cls, str):
        raise ValueError(f"'cls' must be a string, got {type(cls).__name__}")
    if not (is_int(prio) and INT64_MIN <= prio <= INT64_MAX):
        raise ValueError(f"'prio' must be an int64, got {prio!r}")
    req = Request(request_id=rid, arrival_time=_number(m["arrival"], "arrival"), prompt_len=len(prompt),
                  max_output_tokens=sampling.max_tokens, slo=SLO(ttft, tpot), slo_class=cls,
                  priority=prio, prompt_token_ids=prompt, sampling=sampling)
    out = m.get("out")
    if out:                                   # a transfer: prefill done on another instance
        req.output_token_ids = _token_ids(out, "out", vocab_size)
        req.num_output_tokens = len(out)
        computed = m["computed"]
        if not is_int(computed) or not 0 <= computed <= len(prompt) + len(out):
            raise ValueError(f"'computed' must be an integer in [0, {len(prompt) + len(out)}], got {computed!r}")
        req.num_computed_tokens = computed
        t = req.times
        info = m.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError("'info' must be a map")
        t.prefill_start, t.prefill_end = (None if (v := info.get(k)) is None else _number(v, f"info.{k}")
                                          for k in ("prefill_start", "prefill_end"))
        t.first_token = t.last_token = _number(m["t_first"], "t_first")
    return req
