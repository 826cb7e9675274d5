"""Sampling parameters (pure data; the engine's sampler interprets them).

Besides temperature / top-k / top-p / seed and the stop conditions, a request may shape the logits
before sampling (vLLM's semantics, applied by ``laneserve.engine.sampler`` in this order):
``logit_bias`` (token id -> added bias), ``min_tokens`` (EOS and ``stop_token_ids`` masked until
that many tokens were generated), then the penalties: ``repetition_penalty`` over the prompt and
the output (a seen token's positive logit is divided by it, a negative one multiplied, as HF's
``RepetitionPenaltyLogitsProcessor``), ``frequency_penalty`` (minus the penalty times the token's
count in the output) and ``presence_penalty`` (minus the penalty once the token occurs in the
output).

``structured`` (a :class:`~laneserve.core.structured.StructuredSpec`) constrains the output to a
JSON schema, regex, choice or tool call: the engine masks every token the constraint forbids
(``laneserve.engine.structured``), and EOS under a constraint always ends the request.

``n`` > 1 asks for ``n`` samples of one prompt: the prompt is prefilled once, ``n`` first tokens are
drawn from its last logits (sample ``k`` with :meth:`SamplingParams.sample`), and each sample then
decodes as a request of its own.

Construction checks every field's type, range and finiteness (NaN passes ``< 0`` tests, so each
float is checked with :func:`math.isfinite` first): a :class:`SamplingParams` that exists can be
packed for the wire (every int fits int64) and sampled. The API validates requests before they get
here (``laneserve.server.protocol``); this is the instance side, which never trusts the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Integral, Real

from laneserve.core.structured import StructuredSpec

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by them overflows
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0                  # presence/frequency penalties in [-2, 2] (OpenAI's and vLLM's range)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0   # a tiny divisor would overflow logits
MAX_LOGIT_BIAS = 1024              # token ids in one logit_bias map
MAX_BIAS = 100.0                   # |bias| <= 100 (OpenAI's range): enough to force or ban a token
MAX_N = 128                        # samples of one prompt (n, best_of)


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
    #: return, for every prompt token after the first, its logprob and the top-n of its position
    #: (vLLM's ``prompt_logprobs``; ``echo`` with ``logprobs``): its prefill skips the prefix cache
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, ids unique
    min_tokens: int = 0
    structured: StructuredSpec | None = None          # structured output: the text must satisfy this
    n: int = 1                        # samples of the prompt: its KV computed once, n first tokens drawn
    min_p: float = 0.0                # vLLM's min_p: drop tokens less likely than min_p x the likeliest (0 = off)
    allowed_token_ids: tuple[int, ...] = ()   # vLLM's allowed_token_ids: only these may be sampled (() = all)
    #: vLLM's bad_words as token sequences: a sequence's last token is banned where the output ends
    #: with the rest of it (a one-token sequence: always)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
        rp = self.repetition_penalty
        if not is_real(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                             f"got {rp!r}")
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS or not all(
                isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) and 0 <= e[0] <= INT64_MAX
                and is_real(e[1]) and -MAX_BIAS <= e[1] <= MAX_BIAS for e in bias):
            raise ValueError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (token id >= 0, bias in "
                             f"[-{MAX_BIAS}, {MAX_BIAS}]) pairs, got {_short(bias)}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise ValueError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.allowed_token_ids, tuple) or not all(
                is_int(t) and 0 <= t <= INT64_MAX for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be a tuple of int64 >= 0, got "
                             f"{_short(self.allowed_token_ids)}")
        if not isinstance(self.bad_words_ids, tuple) or not all(
                isinstance(w, tuple) and w and all(is_int(t) and 0 <= t <= INT64_MAX for t in w)
                for w in self.bad_words_ids):
            raise ValueError("bad_words_ids must be a tuple of non-empty token-id tuples, got "
                             f"{_short(self.bad_words_ids)}")

    def sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n``-sample request: one sample, and a seed
        of its own derived from the request's as vLLM does (``seed + index``, wrapped to int64)."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the request's token history (any penalty is set)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, logit_bias, min_tokens,
        allowed_token_ids, bad_words_ids)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.allowed_token_ids)
                or bool(self.bad_words_ids))


def _short(v: object, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."
