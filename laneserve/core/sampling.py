"""Sampling parameters (pure data; the engine's sampler interprets them).

Construction checks every field's type, range and finiteness (NaN passes ``< 0`` tests, so each
float is checked with :func:`math.isfinite` first): a :class:`SamplingParams` that exists can be
packed for the wire (every int fits int64) and sampled. The API validates requests before they get
here (``laneserve.server.protocol``); this is the instance side, which never trusts the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by them overflows
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


def is_int(v: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    """A finite real number that is not a bool (an int too large for a float is not finite)."""
    if isinstance(v, bool) or not isinstance(v, Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # < GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 = off
    seed: int | None = None           # any int64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # return the top-n logprobs of each sampled token

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (off) or an int64 >= 1, got {self.top_k!r}")
        if self.seed is not None and not (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an int64, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of int64 >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
