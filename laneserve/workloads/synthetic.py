"""Synthetic workloads where a paper's setup needs them (docs/design.md, "Measuring").

- :func:`flowprefill_mix` — FlowPrefill §6.1: four task classes with Table 1 prompt lengths and mix
  ratios, Table 2 TTFT SLOs per model (:mod:`laneserve.workloads.slo_tables`).
- :func:`alignedserve_mix` — AlignedServe §4.1–4.2: short (< 1000 tokens) and long (1000–8000)
  requests with 70–95 % short.
- :func:`lmsys_multiturn` — LMSys-Chat-1M-like multi-turn chat (LAPS §1 Figure 2, §4).
- :func:`short_long_mix` — a controlled short/long mix for head-of-line-blocking experiments
  (LAPS §2.2, Kairos §2.2).

Class mixes use exact counts (largest remainder) in a seeded random order, so a ratio of 0.9 over
1000 requests gives exactly 900. Everything is deterministic by ``seed``.
"""

from __future__ import annotations

import numpy as np

from laneserve.core.request import RequestSpec
from laneserve.core.slo import SLO
from laneserve.workloads.arrivals import arrival_times
from laneserve.workloads.sessions import build_sessions
from laneserve.workloads.slo_tables import (CHAT_SLO, FLOWPREFILL_CLASSES, LONG_CONTEXT_SLO, flowprefill_model_key,
                                            flowprefill_slos)
from laneserve.workloads.workload import Workload

#: FlowPrefill Table 1 ("Prompt length across diverse tasks"): class -> (mean, p99, std, ratio).
FLOWPREFILL_PROMPT_STATS: dict[str, tuple[float, float, float, float]] = {
    "Text": (590, 3040, 652, 0.68),      # Chatbot (Text)
    "Image": (532, 2764, 510, 0.08),     # Image Understanding (Image)
    "Search": (5976, 16635, 3456, 0.20),  # Web Search (Search)
    "File": (6833, 22390, 5186, 0.04),   # Summarization (File)
}
MAX_PROMPT = 32768


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, std: float, *,
                      lo: int = 1, hi: int = MAX_PROMPT) -> np.ndarray:
    """Integer lengths from the lognormal with this mean and std (moment matching), clipped."""
    sigma2 = np.log1p((std / mean) ** 2)
    mu = np.log(mean) - sigma2 / 2
    return np.clip(np.rint(rng.lognormal(mu, np.sqrt(sigma2), size=n)), lo, hi).astype(np.int64)


def uniform_lengths(rng: np.random.Generator, n: int, span: int | tuple[int, int]) -> np.ndarray:
    """Integer lengths uniform on ``[lo, hi]`` inclusive (a plain int is a constant)."""
    lo, hi = (span, span) if isinstance(span, int | np.integer) else span
    if not 1 <= lo <= hi:
        raise ValueError(f"length range must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
    return rng.integers(lo, hi + 1, size=n)


def exact_mix(rng: np.random.Generator, n: int, ratios: dict[str, float]) -> list[str]:
    """``n`` class labels with counts proportional to ``ratios`` (largest remainder), shuffled."""
    total = sum(ratios.values())
    if not total > 0 or any(r < 0 for r in ratios.values()):
        raise ValueError(f"class ratios must be >= 0 with a positive sum, got {ratios}")
    raw = {k: n * r / total for k, r in ratios.items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - counts[k], reverse=True)[: n - sum(counts.values())]:
        counts[k] += 1
    labels = np.array([k for k, c in counts.items() for _ in range(c)], dtype=object)
    return list(labels[rng.permutation(n)]) if n else []


def _assemble(name: str, labels, prompts, outputs, slos: dict[str, SLO], *, rate: float,
              process: str, cv: float, rng: np.random.Generator, meta: dict) -> Workload:
    times = arrival_times(process, len(labels), rate, cv=cv, seed=int(rng.integers(2**63)))
    specs = tuple(RequestSpec(i, float(t), int(p), int(o), slos[c], slo_class=c)
                  for i, (t, c, p, o) in enumerate(zip(times, labels, prompts, outputs)))
    return Workload(name, specs, {**meta, "rate": rate, "process": process, "cv": cv})


def flowprefill_mix(n: int = 1000, *, model: str = "Llama3-8B", rate: float = 1.0,
                    process: str = "poisson", cv: float = 1.0, seed: int = 0,
                    tpot: float | None = None, output_mean: float = 200.0, output_std: float = 200.0,
                    max_prompt: int = MAX_PROMPT) -> Workload:
    """FlowPrefill's multi-SLO workload (§6.1): classes Text/Image/Search/File.

    Prompt lengths: per class a lognormal matched to Table 1's mean and std (its p99, not fitted,
    comes out at 3162/2510/18060/26170 vs the table's 3040/2764/16635/22390), clipped to
    ``[1, max_prompt]``. Mix: Table 1 ratios 68/8/20/4 %. SLOs: Table 2 TTFT for ``model``
    (:func:`~laneserve.workloads.slo_tables.flowprefill_model_key` resolves names), TPOT ``tpot``.
    Output lengths are not given by the paper (QwenTrace has no outputs in Table 1); they are
    inferred: one lognormal for all classes, mean/std ``output_mean``/``output_std`` (default 200,
    close to the Azure conversation trace's mean 211), clipped to [1, 2048]. Arrivals: QwenTrace
    timestamps are not public, so a Poisson (or gamma ``cv``) process at ``rate``.
    """
    rng = _rng(seed)
    labels = exact_mix(rng, n, {c: FLOWPREFILL_PROMPT_STATS[c][3] for c in FLOWPREFILL_CLASSES})
    prompts = np.empty(n, np.int64)
    for cls in FLOWPREFILL_CLASSES:
        idx = [i for i, c in enumerate(labels) if c == cls]
        mean, _p99, std, _ratio = FLOWPREFILL_PROMPT_STATS[cls]
        prompts[idx] = lognormal_lengths(rng, len(idx), mean, std, hi=max_prompt)
    outputs = lognormal_lengths(rng, n, output_mean, output_std, hi=2048)
    key = flowprefill_model_key(model)
    return _assemble("flowprefill_mix", labels, prompts, outputs, flowprefill_slos(key, tpot=tpot),
                     rate=rate, process=process, cv=cv, rng=rng,
                     meta={"model": key, "seed": seed, "source": "FlowPrefill §6.1 Tables 1-2"})


def alignedserve_mix(n: int = 1000, *, short_ratio: float = 0.9,
                     short_len: tuple[int, int] = (32, 999), long_len: tuple[int, int] = (1000, 8000),
                     output_len: int | tuple[int, int] = (128, 1024), rate: float = 1.0,
                     process: str = "poisson", cv: float = 1.0, seed: int = 0,
                     slo: SLO = CHAT_SLO) -> Workload:
    """AlignedServe's synthetic short/long mixes (§4.1 "Workloads", §4.2: short ratios 70–95 %).

    Short prompts have fewer than 1000 tokens, long ones 1000–8000 (§4.1); the paper gives no
    distribution inside the ranges, so lengths are uniform on them. Output lengths are not given
    either: uniform on ``output_len`` (inferred; long enough for decode batches to grow their KV).
    Classes are ``"short"`` / ``"long"``.
    """
    if not 0.0 <= short_ratio <= 1.0:
        raise ValueError(f"short_ratio must be in [0, 1], got {short_ratio}")
    rng = _rng(seed)
    labels = exact_mix(rng, n, {"short": short_ratio, "long": 1.0 - short_ratio})
    short = uniform_lengths(rng, n, short_len)
    long = uniform_lengths(rng, n, long_len)
    prompts = np.where(np.array(labels) == "short", short, long) if n else short
    outputs = uniform_lengths(rng, n, output_len)
    return _assemble("alignedserve_mix", labels, prompts, outputs, {"short": slo, "long": slo},
                     rate=rate, process=process, cv=cv, rng=rng,
                     meta={"short_ratio": short_ratio, "short_len": short_len, "long_len": long_len,
                           "seed": seed, "source": "AlignedServe §4.1-4.2"})


SHORT_LONG_SLOS = {"short": CHAT_SLO, "long": SLO(ttft=4.0, tpot=0.05)}


def short_long_mix(n: int = 1000, long_share: float = 0.1, *, short_len: int | tuple[int, int] = (32, 256),
                   long_len: int | tuple[int, int] = (4096, 8192),
                   output_len: int | tuple[int, int] = 128, rate: float = 1.0,
                   process: str = "poisson", cv: float = 1.0, seed: int = 0,
                   slo: SLO | dict[str, SLO] | None = None) -> Workload:
    """A controlled mix of short and long prompts for head-of-line-blocking experiments.

    Short (< 256 tokens: LAPS §1's memory-bound short prefills) and long prompts (4–8K, the long
    prefills that block them, LAPS §2.2 / Kairos §2.2) are uniform on their ranges; ``long_share``
    of the requests are long (exact count). Default SLOs: short 0.4 s TTFT (LAPS §4), long 4 s
    (FlowPrefill Table 2, Llama3-8B Search class, mean prompt ~6K), TPOT 50 ms (Kairos §4.1).
    """
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    slos = dict(SHORT_LONG_SLOS) if slo is None else ({"short": slo, "long": slo}
                                                      if isinstance(slo, SLO) else {**SHORT_LONG_SLOS, **slo})
    rng = _rng(seed)
    labels = exact_mix(rng, n, {"short": 1.0 - long_share, "long": long_share})
    short = uniform_lengths(rng, n, short_len)
    long = uniform_lengths(rng, n, long_len)
    prompts = np.where(np.array(labels) == "long", long, short) if n else short
    outputs = uniform_lengths(rng, n, output_len)
    return _assemble("short_long_mix", labels, prompts, outputs, slos, rate=rate, process=process,
                     cv=cv, rng=rng, meta={"long_share": long_share, "short_len": short_len,
                                           "long_len": long_len, "seed": seed})


#: ``(quantile, prompt tokens)`` knots of :func:`long_context_mix`: a long-context chat trace's
#: shape (mean 12.9K tokens, p50 5.5K, p90 37K, p99 62K), log-linear between the knots
LONG_CONTEXT_KNOTS = ((0.0, 600), (0.5, 5500), (0.9, 37000), (0.99, 62000), (1.0, 100000))
LONG_CONTEXT_OUTPUT_MEAN = 193


def long_context_mix(n: int = 400, *, rate: float = 1.0, process: str = "poisson", cv: float = 1.0,
                     seed: int = 0, slo: SLO = LONG_CONTEXT_SLO) -> Workload:
    """Long-context traffic: prompts drawn from :data:`LONG_CONTEXT_KNOTS` (inverse CDF,
    log-linear between the knots: mean ~12.9K tokens, heavy tail to 100K), outputs lognormal with
    mean :data:`LONG_CONTEXT_OUTPUT_MEAN` (std equal to the mean, 1-2048). One SLO class (default
    TTFT 8 s, TPOT 50 ms). The shape where the order prefills finish in decides how many long
    contexts a decode instance carries at once."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _rng(seed)
    quantiles, tokens = zip(*LONG_CONTEXT_KNOTS)
    prompts = np.rint(np.exp(np.interp(rng.random(n), quantiles, np.log(tokens)))).astype(np.int64)
    outputs = lognormal_lengths(rng, n, LONG_CONTEXT_OUTPUT_MEAN, LONG_CONTEXT_OUTPUT_MEAN, hi=2048)
    return _assemble("long_context_mix", ["long_context"] * n, prompts, outputs, {"long_context": slo},
                     rate=rate, process=process, cv=cv, rng=rng, meta={"seed": seed})


def lmsys_multiturn(n_conversations: int = 1000, *, max_turns: int = 8, continue_prob: float = 0.5,
                    rate: float = 1.0, think_time: float = 5.0, max_context: int | None = 8192,
                    seed: int = 0, slo: SLO = CHAT_SLO) -> Workload:
    """LMSys-Chat-1M-like multi-turn chat (synthetic; the dataset itself is not available here).

    Calibrated to LAPS §1 Figure 2: first-turn prompts (with system prompt) are lognormal with
    median 172 and σ 1.2, so 63 % are < 256 tokens; later turns' new tokens are lognormal with
    median 89 and σ 1.2, so 81 % are < 256. Replies: lognormal median 150, σ 0.85 (mean ≈ 215,
    the average response length reported for LMSys-Chat-1M). Turns per conversation:
    1 + geometric(``continue_prob``), mean 2 for 0.5, capped at ``max_turns``. Requests, prefixes
    and think times as in :mod:`laneserve.workloads.sessions`.
    """
    if max_turns < 1 or not 0.0 <= continue_prob < 1.0:
        raise ValueError(f"need max_turns >= 1 and 0 <= continue_prob < 1, got {max_turns}, {continue_prob}")
    rng = _rng(seed)
    turns = np.minimum(rng.geometric(1.0 - continue_prob, size=n_conversations), max_turns)
    total = int(turns.sum())
    first = np.rint(rng.lognormal(np.log(172.0), 1.2, size=n_conversations))
    later = np.rint(rng.lognormal(np.log(89.0), 1.2, size=total))
    replies = np.rint(rng.lognormal(np.log(150.0), 0.85, size=total))
    new = np.clip(later, 1, MAX_PROMPT).astype(np.int64)
    out = np.clip(replies, 1, 4096).astype(np.int64)
    convs, k = [], 0
    for c, t in enumerate(turns.tolist()):
        new[k] = max(1, min(int(first[c]), MAX_PROMPT))
        convs.append(list(zip(new[k:k + t].tolist(), out[k:k + t].tolist())))
        k += t
    specs, meta = build_sessions(convs, rate=rate, think_time=think_time,
                                 seed=int(rng.integers(2**63)), slo=slo, max_context=max_context)
    meta.update(seed=seed, source="LMSys-Chat-1M-like (LAPS §1 Fig. 2)")
    return Workload.from_specs("lmsys_multiturn", specs, meta)
