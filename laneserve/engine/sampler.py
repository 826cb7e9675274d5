"""Token sampling for ``laneserve.core.sampling.SamplingParams``: greedy, temperature, top-k,
top-p, per-request seeds and optional top-n logprobs; plus stop conditions.

Seeded requests draw from a generator seeded with ``(seed, output index)``, so a request's sample
sequence depends only on its seed and logits — not on batching, preemption or on which instance
(prefill or decode, under PD disaggregation) sampled which token. Unseeded requests share the
engine's generator (``EngineConfig.seed``): deterministic for a fixed schedule.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before penalties,
logit_bias, temperature and truncation), like vLLM's default (``raw_logprobs``).

Logit shaping (``SamplingParams.shapes_logits``), before greedy or random choice, in vLLM's order:
``logit_bias`` is added, EOS and ``stop_token_ids`` are masked while fewer than ``min_tokens``
tokens were generated, then the repetition, frequency and presence penalties are applied (formulas
in ``laneserve.core.sampling``). The penalties need the request's tokens: a :class:`TokenHistory`
per request, which the executor keeps and extends by the new output tokens each step (no copy of
the history per step).

The sampler cannot be crashed by a request: any :class:`SamplingParams` that constructs is sampled
(temperatures are applied to max-shifted logits, so a tiny temperature cannot overflow; seeds are
mixed into a 63-bit generator seed; ``logprobs`` is capped at the vocabulary). A logits row that
cannot be sampled — it holds NaN or +inf, or no finite value — fails only its own request:
:meth:`Sampler.sample` finishes every other row and then raises :class:`UnsampleableRows`, which
carries the full result (a placeholder token for the failed rows) and ``rows`` (row -> reason), so
the caller can keep the good rows' tokens and fail the named rows' requests.

Structured output: a row with a :class:`ConstraintState` has every token its constraint forbids
set to ``-inf`` after the logit shaping and before greedy or random choice (logprobs stay those of
the raw logits); a row whose constraint allows nothing fails as above ("no finite logit").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from laneserve.core.sampling import SamplingParams
from laneserve.engine.structured import ConstraintState, apply

GREEDY = SamplingParams(temperature=0.0)
_SEED_STRIDE = 1_000_003
_SEED_MOD = 1 << 63               # generator seeds are taken modulo 2**63: any int64 seed fits
PLACEHOLDER_TOKEN = 0             # the token UnsampleableRows reports for a failed row


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the ``n`` most likely tokens (``[(token_id, logprob)]``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class UnsampleableRows(RuntimeError):
    """Some logits rows could not be sampled. ``rows`` maps a row of the batch to the reason;
    ``tokens``/``logprobs`` are the complete result of the call, valid for every other row (a
    failed row holds ``PLACEHOLDER_TOKEN`` and no logprobs)."""

    def __init__(self, rows: dict[int, str], tokens: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        super().__init__("unsampleable logits rows: " + "; ".join(f"row {r}: {why}" for r, why in rows.items()))
        self.rows = rows
        self.tokens = tokens
        self.logprobs = logprobs


class TokenHistory:
    """One request's token statistics for logit shaping, on the logits' device: ``seen`` (bool,
    ``[vocab]``: prompt and output tokens, for ``repetition_penalty``) and ``counts`` (output token
    counts, for the frequency and presence penalties) when the request has a penalty; the
    ``logit_bias`` ids and values; the ids ``min_tokens`` masks. :meth:`extend` adds the output
    tokens generated since the last call, so the cost per step is that of the new tokens only."""

    __slots__ = ("request", "num_outputs", "seen", "counts", "bias_ids", "bias_values", "stop_ids", "allowed",
                 "bad_words", "tail")

    def __init__(self, request: object, params: SamplingParams, prompt: Sequence[int], vocab_size: int,
                 device: torch.device, eos_token_ids: Iterable[int]) -> None:
        self.request = request           # the request object this history belongs to (identity)
        self.num_outputs = 0
        self.seen = self.counts = self.bias_ids = self.bias_values = self.stop_ids = self.allowed = None
        # bad words: (prefix, banned last token) of each sequence; `tail` = the output's last tokens
        self.bad_words = [(w[:-1], w[-1]) for w in params.bad_words_ids if w[-1] < vocab_size]
        self.tail: tuple[int, ...] = ()
        if params.allowed_token_ids:      # vLLM's allowed_token_ids: every other token is masked
            self.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.allowed[torch.tensor([t for t in params.allowed_token_ids if t < vocab_size], dtype=torch.long,
                                      device=device)] = True
        if params.penalized:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor([t for t in prompt if 0 <= t < vocab_size], dtype=torch.long, device=device)
            self.seen[ids] = True
        bias = [(t, b) for t, b in params.logit_bias if t < vocab_size]
        if bias:
            self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
            self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
        if params.min_tokens:
            # a constrained request may end whenever its constraint accepts: EOS is never banned
            keep_eos = params.ignore_eos or params.structured is not None
            stop = set(params.stop_token_ids) | (set() if keep_eos else set(eos_token_ids))
            self.stop_ids = torch.tensor(sorted(t for t in stop if t < vocab_size), dtype=torch.long, device=device)

    def extend(self, output_token_ids: Sequence[int]) -> None:
        """Count the output tokens past the ones already counted."""
        if self.bad_words:
            keep = max(len(p) for p, _ in self.bad_words)
            self.tail = tuple(output_token_ids[max(0, len(output_token_ids) - keep):]) if keep else ()
        new = output_token_ids[self.num_outputs:]
        if not new:
            return
        self.num_outputs += len(new)
        if self.counts is not None:
            vocab = self.counts.shape[0]
            ids = torch.tensor([t for t in new if 0 <= t < vocab], dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(ids.shape[0], device=self.counts.device))
            self.seen[ids] = True


class Sampler:
    __slots__ = ("_generator",)

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
               histories: Sequence[TokenHistory | None] | None = None,
               states: Sequence[ConstraintState | None] | None = None,
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` ``[S, vocab]`` (fp32); ``output_index[i]`` = how many output tokens row i's
        request already has (seeds the per-request draw, gates ``min_tokens``); ``histories[i]``
        the row's :class:`TokenHistory`, needed where ``params[i].shapes_logits``; ``states[i]`` the
        row's structured-output state (None: unconstrained). Returns token
        ids and logprobs, or raises :class:`UnsampleableRows` (after sampling every other row) if
        some rows cannot be sampled."""
        raw = logits.float()
        logits = _shape(raw, params, output_index, histories)
        if states is not None and any(st is not None for st in states):
            if logits is raw:
                logits = raw.clone()
            apply(logits, states)
        # the step's one synchronisation: tokens and row checks come to the host together (for a
        # batch with random rows, the logits themselves, sampled on the host)
        if all(p.greedy for p in params):
            tokens, codes = torch.stack([logits.argmax(dim=-1), _row_codes(logits)]).tolist()
            cpu_logits = None
        else:
            cpu_logits = logits.cpu()
            tokens, codes = torch.stack([cpu_logits.argmax(dim=-1), _row_codes(cpu_logits)]).tolist()
        bad = {row: _REASONS[code] for row, code in enumerate(codes) if code}
        for row, p in enumerate(params):
            if row in bad:
                tokens[row] = PLACEHOLDER_TOKEN
                continue
            if p.greedy:
                continue
            gen = self._generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + output_index[row]) % _SEED_MOD)
            tokens[row] = _sample_row(cpu_logits[row], p, gen)
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None and row not in bad]
        if wanted:
            lp = torch.log_softmax(raw[wanted], dim=-1).cpu()
            for i, row in enumerate(wanted):
                n = min(params[row].logprobs or 0, lp.shape[-1])
                top_v, top_i = lp[i].topk(n) if n else (lp.new_empty(0), lp.new_empty(0, dtype=torch.long))
                logprobs[row] = TokenLogprobs(tokens[row], float(lp[i, tokens[row]]),
                                              list(zip(top_i.tolist(), top_v.tolist())))
        if bad:
            raise UnsampleableRows(bad, tokens, logprobs)
        return tokens, logprobs


def _shape(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
           histories: Sequence[TokenHistory | None] | None) -> torch.Tensor:
    """``logits`` with logit_bias, the min_tokens mask and the penalties applied (a copy, when any
    row asks for them)."""
    rows = [row for row, p in enumerate(params) if p.shapes_logits]
    if not rows:
        return logits
    if histories is None or any(histories[row] is None for row in rows):
        raise ValueError("rows with penalties, logit_bias or min_tokens need their TokenHistory")
    logits = logits.clone()
    penalized = []
    for row in rows:
        h, p = histories[row], params[row]
        if h.bias_ids is not None:
            logits[row].index_add_(0, h.bias_ids, h.bias_values)
        if h.stop_ids is not None and output_index[row] < p.min_tokens:
            logits[row, h.stop_ids] = float("-inf")
        if h.allowed is not None:
            logits[row].masked_fill_(~h.allowed, float("-inf"))
        for prefix, last in h.bad_words:
            if not prefix or h.tail[len(h.tail) - len(prefix):] == prefix:
                logits[row, last] = float("-inf")
        if p.penalized:
            penalized.append(row)
    if penalized:
        dev = logits.device
        idx = torch.tensor(penalized, device=dev)
        x = logits[idx]
        seen = torch.stack([histories[r].seen for r in penalized])
        counts = torch.stack([histories[r].counts for r in penalized])

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[r], name) for r in penalized], device=dev).unsqueeze(1)
        rp = column("repetition_penalty")
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        x = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
        logits[idx] = x
    return logits


_REASONS = {1: "logits contain NaN", 2: "logits contain +inf", 3: "no finite logit"}


def _row_codes(logits: torch.Tensor) -> torch.Tensor:
    """Per row, on the logits' device (no synchronisation): 0 = sampleable, 1 = holds NaN,
    2 = holds +inf, 3 = no finite value (-inf entries alone are fine: masked tokens)."""
    nan = logits.isnan().any(-1)
    pos_inf = (logits == float("inf")).any(-1)
    none_finite = ~torch.isfinite(logits).any(-1)
    return torch.where(nan, 1, torch.where(pos_inf, 2, torch.where(none_finite, 3, 0)))


def _unsampleable_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows holding NaN or +inf, or no finite value, with the reason."""
    return {row: _REASONS[code] for row, code in enumerate(_row_codes(logits).tolist()) if code}


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    # shift by the max before dividing: the best token scores 0, so no temperature can overflow
    scaled = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs          # mass of strictly more likely tokens
        drop = before >= p.top_p
        drop[0] = False                            # the most likely token is always kept (top_p may be
                                                   # below float32's range and compare as 0)
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0:                                # the best token scores 0: log(min_p) is the cut
        scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def token_stops(token: int, params: SamplingParams, eos_token_ids: Iterable[int]) -> bool:
    """Whether ``token`` ends the request: EOS (unless ``ignore_eos``; under a structured-output
    constraint always: the output is complete) or one of ``stop_token_ids``."""
    if token in params.stop_token_ids:
        return True
    return (not params.ignore_eos or params.structured is not None) and token in eos_token_ids


class StopChecker:
    """Stop *strings* (``SamplingParams.stop``) by incremental detokenisation — the executor only
    checks token ids. Call ``check(req.output_token_ids, req.sampling)`` after each new token was
    appended (``scheduler.update``): it returns the character position in
    ``tokenizer.decode(output_token_ids, skip_special_tokens=True)`` where a stop string starts
    (truncate the text there and finish the request with reason "stop"), or ``None``.

    Per token only the last ``window`` tokens are decoded (enough for the longest stop string plus
    slack), so the cost per token stays constant; the full text is decoded once, on a match.

    As vLLM, no stop string is looked for before ``min_tokens`` tokens exist, and a match must end
    in the text of the ``min_tokens``-th token or later."""

    __slots__ = ("tokenizer", "_window")

    def __init__(self, tokenizer: object, window: int | None = None) -> None:
        self.tokenizer = tokenizer
        self._window = window

    def check(self, output_token_ids: list[int], params: SamplingParams) -> int | None:
        if not params.stop or not output_token_ids or len(output_token_ids) < params.min_tokens:
            return None
        window = self._window or 2 * max(len(s) for s in params.stop) + 8
        decode = self.tokenizer.decode  # type: ignore[attr-defined]
        tail = decode(output_token_ids[-window:], skip_special_tokens=True)
        before = decode(output_token_ids[-window:-1], skip_special_tokens=True)
        # only a match that ends inside the newest token's text is new
        if not any(s in tail[max(0, len(before) - len(s) + 1):] for s in params.stop):
            return None
        full = decode(output_token_ids, skip_special_tokens=True)
        floor = len(decode(output_token_ids[:params.min_tokens - 1], skip_special_tokens=True)) if params.min_tokens else 0
        found = [pos for s in params.stop if (pos := full.find(s, max(0, floor - len(s) + 1))) >= 0]
        return min(found) if found else None
