"""Per-request latency metrics and run summaries with vLLM's definitions (docs/design.md, "Measuring").

Per request (seconds):

- TTFT = ``first_token − arrival``
- E2E  = ``finished − arrival`` (``last_token − arrival`` when no finish time was recorded)
- TPOT = ``(E2E − TTFT) / (output tokens − 1)``; undefined for 1-token outputs, which meet any TPOT
  target and are left out of the TPOT statistics (as vLLM does)
- ITL  = the gaps between consecutive delivered tokens when ``times.token_times`` was recorded;
  otherwise only the mean (= TPOT) and the maximum (``times.max_itl``) are known
- queueing time = ``prefill_start − arrival``

Attainment: a completed request meets TTFT when ``ttft <= slo.ttft`` (no target ⇒ met), TPOT
likewise, "both" when both hold. Aborted, unfinished and rejected requests (refused at admission:
beyond the model's context) count as misses in every attainment and are counted separately; latency statistics cover completed requests only.

:func:`summarize` makes one pass over the requests into numpy columns and derives everything
vectorised, so 100K requests take a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from laneserve.core.request import Phase, Request

#: slack on SLO comparisons so that a latency equal to its target up to float rounding still meets it
SLO_EPS = 1e-9

COMPLETED, ABORTED, UNFINISHED, REJECTED = 0, 1, 2, 3
_STATUS_NAMES = ("completed", "aborted", "unfinished", "rejected")
_NAN = float("nan")


@dataclass(slots=True)
class RequestMetrics:
    """Latencies of one request in seconds; ``None`` where a metric is undefined."""

    request_id: int
    slo_class: str
    status: str                      # "completed" | "aborted" | "unfinished"
    prompt_len: int
    output_tokens: int
    ttft: float | None
    tpot: float | None               # None for outputs of at most one token
    e2el: float | None
    queue_time: float | None
    itl_mean: float | None
    itl_max: float | None
    decode_throughput: float | None  # (output tokens − 1) / (last_token − first_token), tok/s
    meets_ttft: bool
    meets_tpot: bool
    meets_both: bool
    itls: list[float] | None = None  # every inter-token gap, when token times were recorded


def _opt(x: float | None) -> float:
    return _NAN if x is None else x


def _status(req: Request) -> int:
    if req.phase is Phase.FINISHED and req.times.first_token is not None:
        return COMPLETED
    if req.finish_reason == "rejected":
        return REJECTED
    if req.phase is Phase.ABORTED:
        return ABORTED
    return UNFINISHED


def _columns(requests: Iterable[Request]) -> dict[str, Any]:
    """One pass over the requests into flat numpy columns (None → NaN)."""
    rows: list[tuple] = []
    classes: list[str] = []
    tt_rows: list[int] = []
    tt_lens: list[int] = []
    tt_flat: list[float] = []
    for i, r in enumerate(requests):
        t = r.times
        status = _status(r)
        rows.append((r.request_id, status, r.prompt_len, r.num_output_tokens, t.arrival,
                     _opt(t.prefill_start), _opt(t.first_token), _opt(t.last_token),
                     _opt(t.finished), t.max_itl, _opt(r.slo.ttft), _opt(r.slo.tpot)))
        classes.append(r.slo_class)
        if t.token_times is not None and len(t.token_times) >= 2 and status == COMPLETED:
            tt_rows.append(i)
            tt_lens.append(len(t.token_times))
            tt_flat.extend(t.token_times)
    arr = np.array(rows, dtype=np.float64).reshape(len(rows), 12)
    names = ("request_id", "status", "prompt_len", "output_tokens", "arrival", "prefill_start",
             "first_token", "last_token", "finished", "max_itl", "slo_ttft", "slo_tpot")
    cols: dict[str, Any] = {name: arr[:, k] for k, name in enumerate(names)}
    cols["slo_class"] = np.array(classes, dtype=object)
    cols.update(_gaps(np.array(tt_rows, dtype=np.intp), np.array(tt_lens, dtype=np.intp),
                      np.array(tt_flat, dtype=np.float64)))
    return cols


def _gaps(rows: np.ndarray, lens: np.ndarray, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Inter-token gaps of the requests ``rows`` whose token times lie concatenated in ``flat``."""
    if rows.size == 0:
        empty = np.empty(0)
        return {"tt_rows": rows, "tt_gaps": empty, "tt_mean": empty, "tt_max": empty}
    starts = np.cumsum(lens) - lens
    keep = np.ones(flat.size - 1, dtype=bool)
    keep[starts[1:] - 1] = False                      # differences across two requests
    gaps = np.diff(flat)[keep]
    gap_starts = starts - np.arange(rows.size)
    return {"tt_rows": rows, "tt_gaps": gaps,
            "tt_mean": np.add.reduceat(gaps, gap_starts) / (lens - 1),
            "tt_max": np.maximum.reduceat(gaps, gap_starts)}


def _derive(c: dict[str, Any]) -> dict[str, np.ndarray]:
    """The metric definitions, vectorised over the columns of :func:`_columns`."""
    with np.errstate(invalid="ignore", divide="ignore"):
        completed = c["status"] == COMPLETED
        n_out = c["output_tokens"]
        ttft = c["first_token"] - c["arrival"]
        end = np.where(np.isnan(c["finished"]), c["last_token"], c["finished"])
        e2el = end - c["arrival"]
        multi = n_out > 1
        tpot = np.where(multi, (e2el - ttft) / (n_out - 1), _NAN)
        span = c["last_token"] - c["first_token"]
        decode_tput = np.where(multi & (span > 0), (n_out - 1) / span, _NAN)
        itl_mean = tpot.copy()
        itl_max = np.where(multi, c["max_itl"], _NAN)
        itl_mean[c["tt_rows"]] = c["tt_mean"]
        itl_max[c["tt_rows"]] = c["tt_max"]
        slo_ttft, slo_tpot = c["slo_ttft"], c["slo_tpot"]
        meets_ttft = completed & (np.isnan(slo_ttft) | (ttft <= slo_ttft + SLO_EPS))
        meets_tpot = completed & (np.isnan(slo_tpot) | ~multi | (tpot <= slo_tpot + SLO_EPS))
    return {"completed": completed, "ttft": ttft, "e2el": e2el, "tpot": tpot,
            "queue": c["prefill_start"] - c["arrival"], "itl_mean": itl_mean, "itl_max": itl_max,
            "decode_throughput": decode_tput, "meets_ttft": meets_ttft, "meets_tpot": meets_tpot,
            "meets_both": meets_ttft & meets_tpot}


def _none(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def request_metrics(req: Request) -> RequestMetrics:
    """The metrics of one request (see the module docstring for the definitions)."""
    c = _columns([req])
    d = _derive(c)
    tt = req.times.token_times
    return RequestMetrics(
        request_id=req.request_id, slo_class=req.slo_class,
        status=_STATUS_NAMES[int(c["status"][0])], prompt_len=req.prompt_len,
        output_tokens=req.num_output_tokens, ttft=_none(d["ttft"][0]), tpot=_none(d["tpot"][0]),
        e2el=_none(d["e2el"][0]), queue_time=_none(d["queue"][0]),
        itl_mean=_none(d["itl_mean"][0]), itl_max=_none(d["itl_max"][0]),
        decode_throughput=_none(d["decode_throughput"][0]),
        meets_ttft=bool(d["meets_ttft"][0]), meets_tpot=bool(d["meets_tpot"][0]),
        meets_both=bool(d["meets_both"][0]),
        itls=np.diff(tt).tolist() if tt is not None and len(tt) >= 2 else None)


def _pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(out: dict[str, Any], name: str, values: np.ndarray, percentiles: Sequence[float],
           weights: np.ndarray | None = None) -> None:
    """mean/median/std/pXX of ``values`` (seconds) into ``out`` as ``<stat>_<name>_ms``."""
    keys = ["mean", "median", "std", *(_pct_name(p) for p in percentiles)]
    if values.size == 0:
        out.update({f"{k}_{name}_ms": None for k in keys})
        return
    ms = values * 1000.0
    qs = [50.0, *percentiles]
    if weights is None or np.all(weights == 1):
        mean, std = float(ms.mean()), float(ms.std())
        qv = np.percentile(ms, qs)
    else:
        w = weights / weights.sum()
        mean = float(np.dot(w, ms))
        std = float(np.sqrt(np.dot(w, (ms - mean) ** 2)))
        qv = _weighted_percentile(ms, weights, qs)
    out[f"mean_{name}_ms"], out[f"std_{name}_ms"] = mean, std
    out[f"median_{name}_ms"] = float(qv[0])
    for p, v in zip(percentiles, qv[1:]):
        out[f"{_pct_name(p)}_{name}_ms"] = float(v)


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Inverted-CDF percentiles of ``values`` where each value counts ``weights`` times."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    idx = np.searchsorted(cum, np.asarray(qs, dtype=np.float64) / 100.0 * cum[-1], side="left")
    return values[order][np.minimum(idx, values.size - 1)]


def _frac(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if mask.size else None


def summarize(requests: Iterable[Request], *, duration: float | None = None,
              percentiles: Sequence[float] = (90, 99)) -> dict[str, Any]:
    """Aggregate metrics of a run, keyed like ``vllm bench serve`` (``mean_ttft_ms`` …).

    ``duration`` defaults to the span from the first arrival to the last finish. Attainments are
    fractions of *all* requests (failed ones count as misses); latency statistics cover completed
    requests. ITL statistics use every recorded inter-token gap; a request without token times
    contributes its mean ITL weighted by its number of gaps (exact mean, approximate percentiles).
    """
    c = _columns(requests)
    d = _derive(c)
    status, comp = c["status"], d["completed"]
    n_out, n_in = c["output_tokens"], c["prompt_len"]
    if duration is None:
        ends = d["e2el"] + c["arrival"]
        ends = ends[~np.isnan(ends)]
        duration = float(ends.max() - c["arrival"].min()) if ends.size else 0.0
    n_completed = int(comp.sum())
    out: dict[str, Any] = {
        "num_requests": int(status.size), "completed": n_completed,
        "aborted": int((status == ABORTED).sum()), "unfinished": int((status == UNFINISHED).sum()),
        "rejected": int((status == REJECTED).sum()),
        "failed": int(status.size - n_completed), "duration": duration,
        "total_input_tokens": int(n_in[comp].sum()), "total_output_tokens": int(n_out[comp].sum()),
    }
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    out["request_throughput"] = rate(n_completed)
    out["request_goodput"] = rate(int(d["meets_both"].sum()))
    out["output_throughput"] = rate(out["total_output_tokens"])
    out["total_token_throughput"] = rate(out["total_input_tokens"] + out["total_output_tokens"])

    tpot = d["tpot"][comp]
    _stats(out, "ttft", d["ttft"][comp], percentiles)
    _stats(out, "tpot", tpot[~np.isnan(tpot)], percentiles)
    itl_values, itl_weights = _itl_samples(c, d)
    _stats(out, "itl", itl_values, percentiles, weights=itl_weights)
    _stats(out, "e2el", d["e2el"][comp], percentiles)
    queue = d["queue"][comp]
    _stats(out, "queue", queue[~np.isnan(queue)], percentiles)
    itl_max = d["itl_max"][comp]
    itl_max = itl_max[~np.isnan(itl_max)]
    out["max_itl_ms"] = float(itl_max.max() * 1000.0) if itl_max.size else None
    dt = d["decode_throughput"][comp]
    dt = dt[~np.isnan(dt)]
    out["mean_decode_throughput"] = float(dt.mean()) if dt.size else None
    out["median_decode_throughput"] = float(np.median(dt)) if dt.size else None
    out["attainment_ttft"] = _frac(d["meets_ttft"])
    out["attainment_tpot"] = _frac(d["meets_tpot"])
    out["attainment_both"] = _frac(d["meets_both"])
    out["per_class"] = _per_class(c, d)
    return out


def _itl_samples(c: dict[str, Any], d: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ITL values, weights): exact gaps where recorded, else mean ITL × number of gaps."""
    has_tt = np.zeros(c["status"].size, dtype=bool)
    has_tt[c["tt_rows"]] = True
    rest = d["completed"] & ~has_tt & ~np.isnan(d["itl_mean"])
    values = np.concatenate([c["tt_gaps"], d["itl_mean"][rest]])
    weights = np.concatenate([np.ones(c["tt_gaps"].size), c["output_tokens"][rest] - 1])
    return values, weights


def _per_class(c: dict[str, Any], d: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    if c["status"].size == 0:
        return {}
    names, inverse = np.unique(c["slo_class"].astype(str), return_inverse=True)
    result: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(names):
        sel = inverse == k
        comp = sel & d["completed"]
        ttft = d["ttft"][comp]
        tpot = d["tpot"][comp]
        tpot = tpot[~np.isnan(tpot)]
        result[str(name)] = {
            "num_requests": int(sel.sum()), "completed": int(comp.sum()),
            "failed": int(sel.sum() - comp.sum()),
            "attainment_ttft": _frac(d["meets_ttft"][sel]),
            "attainment_tpot": _frac(d["meets_tpot"][sel]),
            "attainment_both": _frac(d["meets_both"][sel]),
            "p90_ttft_ms": float(np.percentile(ttft, 90) * 1000.0) if ttft.size else None,
            "p90_tpot_ms": float(np.percentile(tpot, 90) * 1000.0) if tpot.size else None,
        }
    return result
