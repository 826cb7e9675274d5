"""What one request may take of the server, checked after parsing and before any work: a share
of the admission slots, a share of the KV cache, and a response of bounded size.

- **Admission slots.** Every sequence a request generates (prompts x ``best_of``) holds one of
  ``--max-inflight`` slots until it ends. One request may hold at most ``--max-request-share`` of
  them (default a quarter), so a single ``best_of: 128`` cannot make every other client's request
  a 429.
- **KV.** The tokens its sequences may hold on the decode side (each prompt once, its samples
  sharing it, plus ``max_tokens`` per sample) may fill at most the same share of the cluster's
  decode KV; a request of a single sequence is always allowed the whole of one instance (the
  context check already makes it fit).
- **Response bytes.** A complete answer is built as one JSON document; echo, ``logprobs`` and
  ``prompt_logprobs`` multiply its size (20 alternatives per token of a 4,000-token prompt is a few
  megabytes per choice). The largest possible response is estimated from the request and refused
  past ``--max-response-bytes``; what is allowed is built off the event loop (``api.py``).

Each refusal is a 400 that names the limit and the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per entry of a logprobs block, upper figures for this server's JSON (token text of a few
# characters, a float, the keys; chat's entries carry the token's bytes as a list of ints too)
_BYTES_PER_TOKEN = 24              # a token of text in "text" / "content"
_BYTES_PER_LOGPROB = 64            # a token's own logprob entry (completions / chat shapes)
_BYTES_PER_ALTERNATIVE = 80        # one top-k alternative
_BYTES_PER_PROMPT_LOGPROB = 72     # vLLM prompt_logprobs: {"id": {"logprob", "rank", "decoded_token"}}
_BYTES_PER_CHOICE = 256            # the choice's fixed fields


@dataclass(frozen=True, slots=True)
class RequestBudget:
    max_request_share: float = 0.25        # of admission slots and of decode KV
    max_response_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not 0 < self.max_request_share <= 1:
            raise ValueError("--max-request-share must be in (0, 1]")
        if self.max_response_bytes < 1 << 16:
            raise ValueError("--max-response-bytes must be at least 65536")


class OverBudget(ValueError):
    """The request asks for more than one request may take; ``param`` names the field to change."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def check(budget: RequestBudget, *, prompt_lens: list[int], samples: int, returned: int, max_tokens: int,
          logprobs: int | None, prompt_logprobs: int | None, echo: bool, max_inflight: int,
          decode_kv_tokens: int, instance_kv_tokens: int) -> int:
    """Raise :class:`OverBudget` if the request is over a share or the response cap; returns the
    estimated size of the largest response (bytes)."""
    share = budget.max_request_share
    sequences = len(prompt_lens) * samples
    slots = max(1, int(share * max_inflight))
    if sequences > slots:
        raise OverBudget(f"this request generates {sequences} sequences ({len(prompt_lens)} prompt(s) x {samples} "
                         f"samples); one request may hold at most {slots} of the {max_inflight} admission slots "
                         f"(--max-request-share {share:g} of --max-inflight)", "best_of" if samples > 1 else "prompt")
    size = response_bytes(prompt_lens, returned, max_tokens, logprobs, prompt_logprobs, echo)
    if size > budget.max_response_bytes:
        param = "prompt_logprobs" if prompt_logprobs else "logprobs" if logprobs else "max_tokens"
        raise OverBudget(f"the response to this request may reach {size / 2**20:.1f} MiB (echo, logprobs and "
                         f"prompt_logprobs over {len(prompt_lens)} prompt(s) x {returned} choices), over the limit of "
                         f"{budget.max_response_bytes / 2**20:.1f} MiB (--max-response-bytes)", param)
    kv = sum(n + samples * max_tokens for n in prompt_lens)
    kv_cap = max(int(share * decode_kv_tokens), instance_kv_tokens if sequences == 1 else 0)
    if kv > kv_cap:
        raise OverBudget(f"this request may hold {kv} tokens of KV cache (each prompt plus max_tokens for each of "
                         f"its {samples} samples); one request may hold at most {kv_cap} of the cluster's "
                         f"{decode_kv_tokens} decode KV tokens (--max-request-share {share:g})", "max_tokens")
    return size


def response_bytes(prompt_lens: list[int], returned: int, max_tokens: int, logprobs: int | None,
                   prompt_logprobs: int | None, echo: bool) -> int:
    """An upper estimate of a complete response's JSON size."""
    total = 0
    for n in prompt_lens:
        tokens = max_tokens + (n if echo else 0)
        per_choice = _BYTES_PER_CHOICE + tokens * _BYTES_PER_TOKEN
        if logprobs is not None:
            per_choice += tokens * (_BYTES_PER_LOGPROB + logprobs * _BYTES_PER_ALTERNATIVE)
        if prompt_logprobs is not None:
            per_choice += n * (prompt_logprobs + 1) * _BYTES_PER_PROMPT_LOGPROB
        total += returned * per_choice
    return total
