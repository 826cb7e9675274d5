"""Loaders for real request traces (docs/design.md, "Measuring": real traces first).

- Azure LLM inference trace 2023, conversation (Patel et al., *Splitwise*, ISCA'24;
  Azure/AzurePublicDataset, CC-BY-4.0): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with
  timestamps like ``2023-11-16 18:15:46.6805900`` (7 fractional digits).
- Mooncake conversation trace (Qin et al., *Mooncake*, FAST'25; kvcache-ai/Mooncake, Apache-2.0):
  JSON lines ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}`` where each hash id
  names one 512-token block and equal ids mean an equal prefix up to that block.

Arrival times are re-based so the first request arrives at 0. Paths ending in ``.gz`` are read
transparently. Copies of both traces ship in ``laneserve/workloads/data/`` (see NOTICE.md there).

A trace file carries no SLOs. The loaders' ``slo`` defaults (chat for Azure, long-context for
Mooncake) are the named workloads' tables; ``laneserve sim --trace`` replaces them with one rule
for any file, :class:`IdleLatencySLO`: each request's targets are multiples of its own latency on
an idle instance of the run's cost model, with floors.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.costmodel.base import CostModel
from laneserve.workloads.slo_tables import CHAT_SLO, LONG_CONTEXT_SLO
from laneserve.workloads.workload import Workload

DATA_DIR = Path(__file__).with_name("data")
AZURE_CONV_PATH = DATA_DIR / "azure_conv_2023.csv.gz"
MOONCAKE_CONV_PATH = DATA_DIR / "mooncake_conversation.jsonl.gz"
MOONCAKE_BLOCK_TOKENS = 512
#: the most tokens one trace row may give a prompt or an output (ten million: past any model's
#: context, and a typo such as 10^23 is caught at its row instead of deep inside a run)
MAX_TRACE_TOKENS = 10_000_000


def _check_counts(n_in: int, n_out: int) -> None:
    if n_in < 0 or n_out < 0:
        raise ValueError("negative token count")
    if n_in > MAX_TRACE_TOKENS or n_out > MAX_TRACE_TOKENS:
        raise ValueError(f"token count {max(n_in, n_out)} above the limit of {MAX_TRACE_TOKENS}")


def _no_rows(path: str | Path) -> ValueError:
    return ValueError(f"{path}: the trace has no request rows")


def _read_lines(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8-sig").read().splitlines()


def _parse_azure_timestamp(text: str, day_cache: dict[str, int]) -> tuple[int, float]:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` (no timezone) as (whole seconds since day 1, fraction);
    split so that differences keep sub-microsecond precision (epoch seconds as one float do not)."""
    day, clock = text.split(" ", 1) if " " in text else text.split("T", 1)
    base = day_cache.get(day)
    if base is None:
        base = day_cache[day] = date.fromisoformat(day).toordinal() * 86400
    h, m, s = clock.split(":")
    whole, _, frac = s.partition(".")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in {text!r}")
    return base + int(h) * 3600 + int(m) * 60 + int(whole), float("0." + frac) if frac else 0.0


def load_azure_csv(path: str | Path = AZURE_CONV_PATH, *, limit: int | None = None,
                   slo: SLO = CHAT_SLO, name: str = "azure_conv") -> Workload:
    """Load an Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Rows with 0 context or generated tokens are clamped to 1 token (a request needs at least one
    of each); the count is in ``meta["clamped_rows"]``. ``limit`` keeps the first rows.
    """
    lines = _read_lines(path)
    if not lines:
        raise ValueError(f"{path}: empty file")
    header = [c.strip() for c in lines[0].split(",")]
    try:
        col_t, col_in, col_out = (header.index(c) for c in ("TIMESTAMP", "ContextTokens",
                                                            "GeneratedTokens"))
    except ValueError:
        raise ValueError(f"{path}:1: expected header TIMESTAMP,ContextTokens,GeneratedTokens, "
                         f"got {lines[0]!r}") from None
    rows: list[tuple[tuple[int, float], int, int]] = []
    clamped = 0
    day_cache: dict[str, int] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        cols = line.split(",")
        try:
            t = _parse_azure_timestamp(cols[col_t].strip(), day_cache)
            n_in, n_out = int(cols[col_in]), int(cols[col_out])
            _check_counts(n_in, n_out)
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path}:{lineno}: malformed Azure trace row {line!r}: {e}") from None
        if n_in < 1 or n_out < 1:
            clamped += 1
            n_in, n_out = max(n_in, 1), max(n_out, 1)
        rows.append((t, n_in, n_out))
    if not rows:
        raise _no_rows(path)
    rows.sort(key=lambda r: r[0])
    w0, f0 = rows[0][0]
    specs = tuple(RequestSpec(i, (w - w0) + (f - f0), n_in, n_out, slo)
                  for i, ((w, f), n_in, n_out) in enumerate(rows))
    meta = {"source": str(path), "format": "azure_csv", "clamped_rows": clamped,
            "notes": (f"{clamped} rows with 0 tokens clamped to 1" if clamped else "")}
    return Workload(name, specs, meta)


def load_mooncake_jsonl(path: str | Path = MOONCAKE_CONV_PATH, *, limit: int | None = None,
                        slo: SLO = LONG_CONTEXT_SLO, name: str = "mooncake_conv",
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Workload:
    """Load a Mooncake trace (JSON lines, ``timestamp`` in ms).

    ``hash_ids`` go to ``RequestSpec.hash_ids``. ``prefix_len`` estimates a prefix-cache hit:
    ``block_tokens`` × the number of leading hash ids already seen in an earlier request (in file
    order), capped at ``prompt_len - 1`` so at least one token is prefilled.
    """
    lines = _read_lines(path)
    seen: set[int] = set()
    rows: list[tuple[float, int, int, tuple[int, ...], int]] = []
    decode = json.JSONDecoder().decode
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            r = decode(line)
            t, n_in, n_out = float(r["timestamp"]) / 1000.0, int(r["input_length"]), int(r["output_length"])
            hash_ids = tuple(int(h) for h in r.get("hash_ids") or ())
            if not math.isfinite(t):
                raise ValueError(f"timestamp {r['timestamp']!r} is not a finite number")
            if n_in < 1 or n_out < 1:
                raise ValueError(f"input_length {n_in} / output_length {n_out} must be >= 1")
            _check_counts(n_in, n_out)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ValueError(f"{path}:{lineno}: malformed Mooncake trace row: {e}") from None
        hits = 0
        for h in hash_ids:
            if h not in seen:
                break
            hits += 1
        seen.update(hash_ids)
        rows.append((t, n_in, n_out, hash_ids, min(hits * block_tokens, n_in - 1)))
    if not rows:
        raise _no_rows(path)
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    specs = tuple(RequestSpec(i, t - t0, n_in, n_out, slo, prefix_len=prefix, hash_ids=hids)
                  for i, (t, n_in, n_out, hids, prefix) in enumerate(rows))
    meta = {"source": str(path), "format": "mooncake_jsonl", "block_tokens": block_tokens}
    return Workload(name, specs, meta)


def detect_format(path: str | Path) -> str:
    """``"azure_csv"`` or ``"mooncake_jsonl"``, decided by the first non-empty line's content."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        try:
            if "input_length" in json.loads(first):
                return "mooncake_jsonl"
        except json.JSONDecodeError:
            pass
    elif "TIMESTAMP" in first and "ContextTokens" in first:
        return "azure_csv"
    raise ValueError(f"{path}: unrecognised trace format (expected an Azure CSV header "
                     f"'TIMESTAMP,ContextTokens,GeneratedTokens' or Mooncake JSON lines); "
                     f"first line: {first[:80]!r}")


def load_trace(path: str | Path, **opts) -> Workload:
    """Load an Azure CSV or a Mooncake JSONL trace, detecting the format from the content."""
    fmt = detect_format(path)
    loader = load_azure_csv if fmt == "azure_csv" else load_mooncake_jsonl
    opts.setdefault("name", Path(path).name.split(".")[0])
    return loader(path, **opts)


@dataclass(frozen=True, slots=True)
class IdleLatencySLO:
    """The SLO rule of ``laneserve sim --trace``: a request's TTFT target is ``ttft_multiple`` × its
    whole prompt's prefill time alone on an idle instance, at least ``ttft_floor``; its TPOT target
    is ``tpot_multiple`` × one decode step of it alone at its final context, at least
    ``tpot_floor`` (both on the run's cost model). The floors are the chat table's targets
    (0.4 s, 50 ms; :data:`~laneserve.workloads.slo_tables.CHAT_SLO`), so short prompts get the usual
    chat SLO and long ones proportionally more. A target given explicitly replaces its rule."""

    ttft_multiple: float = 4.0
    ttft_floor: float = 0.4
    tpot_multiple: float = 4.0
    tpot_floor: float = 0.05

    def describe(self, ttft: float | None = None, tpot: float | None = None) -> str:
        t = (f"TTFT {ttft:g} s" if ttft is not None else
             f"TTFT = max({self.ttft_floor:g} s, {self.ttft_multiple:g} x the request's idle prefill time)")
        d = (f"TPOT {tpot * 1000:g} ms" if tpot is not None else
             f"TPOT = max({self.tpot_floor * 1000:g} ms, {self.tpot_multiple:g} x its idle decode step "
             f"at its final context)")
        return f"{t}; {d}"

    def slo(self, prompt_len: int, output_len: int, cost: CostModel, *, ttft: float | None = None,
            tpot: float | None = None) -> SLO:
        if ttft is None:
            ttft = max(self.ttft_floor, self.ttft_multiple * cost.prefill_time([(prompt_len, 0)]))
        if tpot is None:
            tpot = max(self.tpot_floor, self.tpot_multiple * cost.decode_step_time([prompt_len + output_len]))
        return SLO(ttft, tpot)

    def apply(self, workload: Workload, cost: CostModel, *, ttft: float | None = None,
              tpot: float | None = None) -> Workload:
        """``workload`` with every request's SLO set by the rule (``ttft``/``tpot``: fixed targets)."""
        specs = [replace(s, slo=self.slo(s.prompt_len, s.output_len, cost, ttft=ttft, tpot=tpot))
                 for s in workload.specs]
        return Workload(workload.name, tuple(specs), {**workload.meta, "slo_rule": self.describe(ttft, tpot)})
