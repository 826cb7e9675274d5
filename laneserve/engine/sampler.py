"""Token sampling for ``laneserve.core.sampling.SamplingParams``: greedy, temperature, top-k,
top-p, per-request seeds and optional top-n logprobs; plus stop conditions.

Seeded requests draw from a generator seeded with ``(seed, output index)``, so a request's sample
sequence depends only on its seed and logits — not on batching, preemption or on which instance
(prefill or decode, DESIGN.md PD disaggregation) sampled which token. Unseeded requests share the
engine's generator (``EngineConfig.seed``): deterministic for a fixed schedule.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before temperature
and truncation), like vLLM's default.

The sampler cannot be crashed by a request: any :class:`SamplingParams` that constructs is sampled
(temperatures are applied to max-shifted logits, so a tiny temperature cannot overflow; seeds are
mixed into a 63-bit generator seed; ``logprobs`` is capped at the vocabulary). A logits row that
cannot be sampled — it holds NaN or +inf, or no finite value — fails only its own request:
:meth:`Sampler.sample` finishes every other row and then raises :class:`UnsampleableRows`, which
carries the full result (a placeholder token for the failed rows) and ``rows`` (row -> reason), so
the caller can keep the good rows' tokens and fail the named rows' requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from laneserve.core.sampling import SamplingParams

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


class Sampler:
    __slots__ = ("_generator",)

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_index: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` ``[S, vocab]`` (fp32); ``output_index[i]`` = how many output tokens row i's
        request already has (seeds the per-request draw). Returns token ids and logprobs, or raises
        :class:`UnsampleableRows` (after sampling every other row) if some rows cannot be sampled."""
        logits = logits.float()
        bad = _unsampleable_rows(logits)
        tokens = logits.argmax(dim=-1).tolist()
        cpu_logits = None
        for row, p in enumerate(params):
            if row in bad:
                tokens[row] = PLACEHOLDER_TOKEN
                continue
            if p.greedy:
                continue
            if cpu_logits is None:
                cpu_logits = logits.cpu()
            gen = self._generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + output_index[row]) % _SEED_MOD)
            tokens[row] = _sample_row(cpu_logits[row], p, gen)
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None and row not in bad]
        if wanted:
            lp = torch.log_softmax(logits[wanted], dim=-1).cpu()
            for i, row in enumerate(wanted):
                n = min(params[row].logprobs or 0, lp.shape[-1])
                top_v, top_i = lp[i].topk(n) if n else (lp.new_empty(0), lp.new_empty(0, dtype=torch.long))
                logprobs[row] = TokenLogprobs(tokens[row], float(lp[i, tokens[row]]),
                                              list(zip(top_i.tolist(), top_v.tolist())))
        if bad:
            raise UnsampleableRows(bad, tokens, logprobs)
        return tokens, logprobs


def _unsampleable_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows holding NaN or +inf, or no finite value (-inf entries alone are fine: masked tokens)."""
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return {}
    nan = logits.isnan().any(-1).tolist()
    pos_inf = (logits == float("inf")).any(-1).tolist()
    any_finite = finite.any(-1).tolist()
    bad = {}
    for row, (n, p, f) in enumerate(zip(nan, pos_inf, any_finite)):
        if n or p or not f:
            bad[row] = "logits contain NaN" if n else "logits contain +inf" if p else "no finite logit"
    return bad


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
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def token_stops(token: int, params: SamplingParams, eos_token_ids: Iterable[int]) -> bool:
    """Whether ``token`` ends the request: EOS (unless ``ignore_eos``) or one of ``stop_token_ids``."""
    if token in params.stop_token_ids:
        return True
    return not params.ignore_eos and token in eos_token_ids


class StopChecker:
    """Stop *strings* (``SamplingParams.stop``) by incremental detokenisation — the executor only
    checks token ids. Call ``check(req.output_token_ids, req.sampling)`` after each new token was
    appended (``scheduler.update``): it returns the character position in
    ``tokenizer.decode(output_token_ids, skip_special_tokens=True)`` where a stop string starts
    (truncate the text there and finish the request with reason "stop"), or ``None``.

    Per token only the last ``window`` tokens are decoded (enough for the longest stop string plus
    slack), so the cost per token stays constant; the full text is decoded once, on a match."""

    __slots__ = ("tokenizer", "_window")

    def __init__(self, tokenizer: object, window: int | None = None) -> None:
        self.tokenizer = tokenizer
        self._window = window

    def check(self, output_token_ids: list[int], params: SamplingParams) -> int | None:
        if not params.stop or not output_token_ids:
            return None
        window = self._window or 2 * max(len(s) for s in params.stop) + 8
        decode = self.tokenizer.decode  # type: ignore[attr-defined]
        tail = decode(output_token_ids[-window:], skip_special_tokens=True)
        before = decode(output_token_ids[-window:-1], skip_special_tokens=True)
        # only a match that ends inside the newest token's text is new
        if not any(s in tail[max(0, len(before) - len(s) + 1):] for s in params.stop):
            return None
        full = decode(output_token_ids, skip_special_tokens=True)
        found = [pos for s in params.stop if (pos := full.find(s)) >= 0]
        return min(found) if found else None
