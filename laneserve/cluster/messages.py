"""Messages between the API/router process and the instance processes (issue 6, "talking over
ZeroMQ with compact serialized messages").

Every message is one msgpack map with a short kind ``k``. Router -> instance:

- ``add``      a new request for a prefill (or colocated) instance: :func:`request_fields`
- ``transfer`` a prefilled request for a decode instance: request fields + ``out`` (tokens so far),
  ``computed`` (KV tokens), ``t_first`` (first-token time) and ``kv`` (a transport descriptor)
- ``abort``    ``rids``: drop these requests wherever they are on the instance and free their KV
- ``stop``     shut down

Instance -> router (every message carries ``inst``, the instance id):

- ``ready``    the model is loaded; ``info`` = limits the API validates against
- ``tok``      ``items`` = ``[[rid, new_token_ids, finish_reason|None, logprobs|None, info|None], ...]``
  (one message per engine step, so one per batch rather than one per token)
- ``handoff``  a prefill finished: ``rid``, ``out``, ``computed``, ``kv``, ``t_first``, ``lp``, ``info``
- ``stats``    load figures for routers, metrics and admission control (``added`` = ADDs
  processed, so the router can add what it sent after the snapshot)
- ``err``      ``rids`` failed on the instance; ``msg`` says why

Times are seconds on one epoch shared by all processes (:class:`EpochClock`): ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from laneserve.core.request import Request
from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                    "ignore_eos", "logprobs")


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
    return d


def sampling_from_dict(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ())
    d["stop"] = tuple(d.get("stop") or ())
    return SamplingParams(**{k: v for k, v in d.items() if k in _SAMPLING_FIELDS})


def request_fields(rid: int, prompt_ids: list[int], sampling: SamplingParams, arrival: float,
                   slo: SLO, slo_class: str = "default", priority: int = 0) -> dict[str, Any]:
    return {"rid": rid, "prompt": prompt_ids, "sp": sampling_to_dict(sampling), "arrival": arrival,
            "slo": [slo.ttft, slo.tpot], "cls": slo_class, "prio": priority}


def request_from_fields(m: dict[str, Any]) -> Request:
    """The engine-side :class:`Request` of an ``add`` or ``transfer`` message."""
    sampling = sampling_from_dict(m["sp"])
    prompt = list(m["prompt"])
    ttft, tpot = m["slo"]
    req = Request(request_id=int(m["rid"]), arrival_time=float(m["arrival"]), prompt_len=len(prompt),
                  max_output_tokens=sampling.max_tokens, slo=SLO(ttft, tpot), slo_class=m.get("cls", "default"),
                  priority=int(m.get("prio", 0)), prompt_token_ids=prompt, sampling=sampling)
    out = m.get("out")
    if out:                                   # a transfer: prefill done on another instance
        req.output_token_ids = list(out)
        req.num_output_tokens = len(out)
        req.num_computed_tokens = int(m["computed"])
        t = req.times
        info = m.get("info") or {}
        t.prefill_start = info.get("prefill_start")
        t.prefill_end = info.get("prefill_end")
        t.first_token = t.last_token = float(m["t_first"])
    return req
