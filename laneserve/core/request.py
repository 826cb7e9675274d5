"""Request and SLO state (docs/design.md, "The central contract").

A request is counters over a token list: ``num_computed_tokens`` counts tokens whose KV exists, so
chunked prefill, prefix reuse and decode all follow one rule. The same object is used by the
simulator (token ids absent, output length known from the trace) and by the engine (token ids
present, output ends at a stop condition or ``max_output_tokens``).

Token positions: after the prefill of ``prompt_len`` tokens the first output token is sampled;
each decode step then processes the newest output token with a KV context of
``prompt_len + num_output_tokens`` tokens (see :attr:`Request.context_len`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from laneserve.core.sampling import SamplingParams
from laneserve.core.slo import SLO

R = TypeVar("R")


class Phase(str, Enum):
    WAITING = "waiting"              # queued for prefill, nothing computed
    PREFILLING = "prefilling"        # some prompt tokens computed (chunked) or running
    PREEMPTED = "preempted"          # prefill parked mid-way (operator/layer/chunk boundary)
    TRANSFERRING = "transferring"    # prompt done, KV moving to a decode instance
    DECODE_WAITING = "decode_waiting"  # KV ready, waiting for a decode slot / memory
    DECODING = "decoding"
    SWAPPED = "swapped"              # decode KV parked in the host pool
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """Immutable description of a request in a workload; :meth:`Request.from_spec` makes the
    mutable runtime object, so one workload can be replayed many times."""

    request_id: int
    arrival_time: float
    prompt_len: int
    output_len: int
    slo: SLO = SLO()
    slo_class: str = "default"
    priority: int = 0
    prefix_len: int = 0                 # leading prompt tokens shared with earlier requests
    session_id: int | None = None       # multi-turn conversation id
    turn: int = 0
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None   # Mooncake prefix-block ids (512 tokens each)

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id}: output_len must be >= 1, got {self.output_len}")
        if not 0 <= self.prefix_len < self.prompt_len + 1:
            raise ValueError(f"request {self.request_id}: prefix_len {self.prefix_len} outside [0, prompt_len]")
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id}: negative arrival_time")


@dataclass(slots=True)
class RequestTimes:
    """Timestamps of every phase (absolute seconds on the run's clock; ``None`` = not reached)."""

    arrival: float
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None
    decode_start: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    max_itl: float = 0.0
    token_times: list[float] | None = None   # every delivered token, when recording is on


@dataclass(slots=True)
class PolicyState:
    """What the scheduling layers keep on a request. The core's own memos are typed fields (the
    owner named in each comment); a policy's per-request fields live in a record type the policy
    defines, reached with :meth:`of` (one instance per record type and request, made on first use),
    so the core names no policy and a policy's record changes without touching it."""

    prefix_memo: tuple | None = None     # prefill: (cache, cache version, cached tokens) of the last lookup
    prefix_blocks: tuple | None = None   # core.prefix_cache: the prompt's workload-named blocks
    block_hashes: tuple | None = None    # core.kv / core.prefix_summary: ((root, block size), chain names)
    records: dict[type, Any] | None = None

    def of(self, record: type[R]) -> R:
        """This request's ``record`` (a class built with no arguments), made on first use."""
        records = self.records
        if records is None:
            records = self.records = {}
        mine = records.get(record)
        if mine is None:
            mine = records[record] = record()
        return mine

    def peek(self, record: type[R]) -> R | None:
        """This request's ``record`` if a policy made one, else None (nothing is made)."""
        return None if self.records is None else self.records.get(record)


@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    arrival_time: float
    prompt_len: int
    max_output_tokens: int
    slo: SLO
    slo_class: str = "default"
    priority: int = 0
    prefix_len: int = 0
    session_id: int | None = None
    turn: int = 0
    prompt_token_ids: list[int] | None = None
    hash_ids: tuple[int, ...] | None = None
    output_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None   # engine only; the simulator samples nothing
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens found cached when prefill started
    #: engine, with ``sampling.prompt_logprobs``: ``[logprob, [[id, logprob], ...]]`` of prompt
    #: tokens 1, 2, ... as the prefill computes them (token 0 has none)
    prompt_logprobs: list | None = None
    num_output_tokens: int = 0
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None     # "length" | "stop" | "abort" | "error"
    num_preemptions: int = 0
    prefill_instance: int | None = None
    decode_instance: int | None = None
    times: RequestTimes = field(default=None)  # type: ignore[assignment]
    policy_state: PolicyState = field(default_factory=PolicyState)

    def __post_init__(self) -> None:
        if self.times is None:
            self.times = RequestTimes(arrival=self.arrival_time)

    @classmethod
    def from_spec(cls, spec: RequestSpec, *, slo_scale: float = 1.0,
                  record_token_times: bool = False) -> Request:
        slo = spec.slo.scaled(slo_scale) if slo_scale != 1.0 else spec.slo
        req = cls(request_id=spec.request_id, arrival_time=spec.arrival_time,
                  prompt_len=spec.prompt_len, max_output_tokens=spec.output_len, slo=slo,
                  slo_class=spec.slo_class, priority=spec.priority, prefix_len=spec.prefix_len,
                  session_id=spec.session_id, turn=spec.turn,
                  prompt_token_ids=list(spec.prompt_token_ids) if spec.prompt_token_ids else None,
                  hash_ids=spec.hash_ids)
        if record_token_times:
            req.times.token_times = []
        return req

    # ---- derived state -------------------------------------------------------------------
    @property
    def remaining_prefill(self) -> int:
        return self.prompt_len - self.num_computed_tokens if self.num_computed_tokens < self.prompt_len else 0

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    @property
    def context_len(self) -> int:
        """KV length of the next decode step, counting the token it processes."""
        return self.prompt_len + self.num_output_tokens

    @property
    def remaining_output(self) -> int:
        return self.max_output_tokens - self.num_output_tokens

    @property
    def ttft_deadline(self) -> float:
        """Absolute time by which the first token is due (infinity without a TTFT target)."""
        return self.arrival_time + self.slo.ttft if self.slo.ttft is not None else float("inf")

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED or self.phase is Phase.ABORTED

    # ---- state changes -------------------------------------------------------------------
    def record_token(self, now: float, token_id: int | None = None) -> None:
        """One output token was produced (and delivered) at ``now``."""
        t = self.times
        if t.first_token is None:
            t.first_token = now
        elif now - t.last_token > t.max_itl:  # type: ignore[operator]
            t.max_itl = now - t.last_token    # type: ignore[operator]
        t.last_token = now
        if t.token_times is not None:
            t.token_times.append(now)
        self.num_output_tokens += 1
        if token_id is not None:
            if self.output_token_ids is None:
                self.output_token_ids = []
            self.output_token_ids.append(token_id)

    def finish(self, now: float, reason: str = "length") -> None:
        self.phase = Phase.FINISHED if reason in ("length", "stop") else Phase.ABORTED
        self.finish_reason = reason
        self.times.finished = now

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, phase={self.phase.value}, prompt={self.prompt_len}, "
                f"computed={self.num_computed_tokens}, out={self.num_output_tokens}/{self.max_output_tokens})")
