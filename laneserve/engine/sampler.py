"""Token sampling for ``laneserve.core.sampling.SamplingParams``: greedy, temperature, top-k,
top-p, per-request seeds and optional top-n logprobs; plus stop conditions.

Seeded requests draw from a generator seeded with ``(seed, output index)``, so a request's sample
sequence depends only on its seed and logits — not on batching, preemption or on which instance
(prefill or decode, DESIGN.md PD disaggregation) sampled which token. Unseeded requests share the
engine's generator (``EngineConfig.seed``): deterministic for a fixed schedule.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before temperature
and truncation), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from laneserve.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
_SEED_STRIDE = 1_000_003


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the ``n`` most likely tokens (``[(token_id, logprob)]``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    __slots__ = ("_generator",)

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_index: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` ``[S, vocab]`` (fp32); ``output_index[i]`` = how many output tokens row i's
        request already has (seeds the per-request draw). Returns token ids and logprobs."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        cpu_logits = None
        for row, p in enumerate(params):
            if p.greedy:
                continue
            if cpu_logits is None:
                cpu_logits = logits.cpu()
            gen = self._generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(p.seed * _SEED_STRIDE + output_index[row])
            tokens[row] = _sample_row(cpu_logits[row], p, gen)
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(logits[wanted], dim=-1).cpu()
            for i, row in enumerate(wanted):
                n = params[row].logprobs or 0
                top_v, top_i = lp[i].topk(n) if n else (lp.new_empty(0), lp.new_empty(0, dtype=torch.long))
                logprobs[row] = TokenLogprobs(tokens[row], float(lp[i, tokens[row]]),
                                              list(zip(top_i.tolist(), top_v.tolist())))
        return tokens, logprobs


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs          # mass of strictly more likely tokens
        drop = before >= p.top_p                   # the most likely token is always kept
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
