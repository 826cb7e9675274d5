"""Fitted latency predictors: the policies' online predictors and the engine-twin cost model
(docs/design.md, "Cost models").

* :class:`PolynomialTTFT` - FlowPrefill §5 (TTFT prediction): a polynomial of TTFT in the token
  count, least-squares fitted to a prefill profile.
* :class:`StepTimeLUT` - Kairos §3 (Algorithm 3): a (batch size, sequence length) table of decode
  step times, profiled once and updated online with the running mean of observed steps.
* :class:`~laneserve.costmodel.laps_fit.LapsPrefillModel` - LAPS §2.1 (re-exported here).
* :class:`FittedCostModel` - the full :class:`~laneserve.costmodel.base.CostModel` from an engine
  profile (:mod:`laneserve.costmodel.profile`), so the simulator can be the engine's twin.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .base import LAYER_OPERATORS, CostModel, PrefillBatch
from .laps_fit import LapsPrefillModel, nnls
from .profile import Profile
from .specs import H100_SXM, LinkSpec, fit_link

__all__ = ["PolynomialTTFT", "StepTimeLUT", "LapsPrefillModel", "LinearStepModel", "FittedCostModel",
           "prefill_features", "decode_features", "nnls"]


@dataclass(slots=True)
class PolynomialTTFT:
    """TTFT(tokens) = sum_k coefficients[k] * tokens**k (ascending powers), clamped at 0."""

    degree: int = 2
    coefficients: list[float] = field(default_factory=list)

    def fit(self, samples: Iterable[tuple[float, float]], *, relative: bool = True) -> PolynomialTTFT:
        """Least squares over (tokens, seconds); ``relative`` weighs each sample by 1/seconds so
        short prefills are predicted as well as long ones."""
        data = np.asarray(list(samples), dtype=float)
        if len(data) < self.degree + 1:
            raise ValueError(f"need at least {self.degree + 1} samples for degree {self.degree}")
        scale = float(np.max(np.abs(data[:, 0]))) or 1.0
        design = np.vander(data[:, 0] / scale, self.degree + 1, increasing=True)
        target = data[:, 1]
        if relative:
            weights = 1.0 / np.maximum(np.abs(target), 1e-12)
            design, target = design * weights[:, None], target * weights
        coef, *_ = np.linalg.lstsq(design, target, rcond=None)
        self.coefficients = [float(c / scale**k) for k, c in enumerate(coef)]
        return self

    def predict_batch(self, tokens: Sequence[float] | np.ndarray) -> np.ndarray:
        if not self.coefficients:
            raise RuntimeError("PolynomialTTFT is not fitted")
        x = np.asarray(tokens, dtype=float)
        return np.maximum(np.polynomial.polynomial.polyval(x, self.coefficients), 0.0)

    def predict(self, tokens: float) -> float:
        return float(self.predict_batch([tokens])[0])

    def to_dict(self) -> dict:
        return {"degree": self.degree, "coefficients": list(self.coefficients)}

    @classmethod
    def from_dict(cls, data: dict) -> PolynomialTTFT:
        return cls(int(data["degree"]), [float(c) for c in data["coefficients"]])

    @classmethod
    def from_cost_model(cls, model: CostModel, token_grid: Sequence[int] = tuple(2**k for k in range(4, 16)),
                        degree: int = 2) -> PolynomialTTFT:
        return cls(degree).fit((n, model.prefill_time([(n, 0)])) for n in token_grid)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2**k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1))


@dataclass(slots=True)
class StepTimeLUT:
    """Kairos' step-time table. Cell ``(i, j)`` holds the mean step time of batches of up to
    ``batch_edges[i]`` requests whose longest sequence is up to ``length_edges[j]`` tokens (an
    observation goes to the smallest edge >= its value). ``lookup`` interpolates bilinearly in
    log2 space between filled grid points, falls back to the nearest filled cell, and clamps
    beyond the last edges.

    ``means`` is written through :meth:`set`, :meth:`observe` and :meth:`fill_unobserved` only: they keep a plain-float
    mirror of it (``lookup`` is a decode policy's hot path, called per request per step, and
    indexing a numpy array per call costs more than the whole interpolation)."""

    batch_edges: tuple[int, ...] = _powers_of_two(1, 2048)
    length_edges: tuple[int, ...] = _powers_of_two(16, 2**20)
    interpolate: bool = True
    means: np.ndarray = field(init=False, repr=False)
    counts: np.ndarray = field(init=False, repr=False)
    _rows: list[list[float]] = field(init=False, repr=False, compare=False)     # means as floats
    _log_edges: tuple[tuple[float, ...], tuple[float, ...]] = field(init=False, repr=False, compare=False)
    #: memoised :meth:`_position` of batch sizes and lengths (a simulation asks for the same ones)
    _positions: tuple[dict, dict] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for edges in (self.batch_edges, self.length_edges):
            if not edges or list(edges) != sorted(set(edges)) or edges[0] < 1:
                raise ValueError("edges must be increasing positive integers")
        self.batch_edges, self.length_edges = tuple(self.batch_edges), tuple(self.length_edges)
        self._log_edges = (tuple(map(math.log2, self.batch_edges)), tuple(map(math.log2, self.length_edges)))
        self._positions = ({}, {})
        self._set_means(np.full((len(self.batch_edges), len(self.length_edges)), np.nan))
        self.counts = np.zeros(self.means.shape, dtype=np.int64)

    def _set_means(self, means: np.ndarray) -> None:
        self.means = means
        self._rows = means.tolist()

    @staticmethod
    def _bucket(edges: tuple[int, ...], value: float) -> int:
        return min(bisect_left(edges, value), len(edges) - 1)

    def set(self, batch_size: int, length: int, seconds: float, count: int = 1) -> None:
        i, j = self._bucket(self.batch_edges, batch_size), self._bucket(self.length_edges, length)
        self.means[i, j], self.counts[i, j] = seconds, count
        self._rows[i][j] = float(self.means[i, j])

    def fill_unobserved(self, other: StepTimeLUT) -> None:
        """Every cell nothing was observed in takes ``other``'s value (same edges)."""
        if (other.batch_edges, other.length_edges) != (self.batch_edges, self.length_edges):
            raise ValueError("fill_unobserved needs a table with the same edges")
        empty = self.counts == 0
        means = self.means.copy()
        means[empty] = other.means[empty]
        self._set_means(means)

    def observe(self, batch_size: int, length: int, seconds: float) -> None:
        """Fold an observed step time into its cell's running (historical) mean."""
        i, j = self._bucket(self.batch_edges, batch_size), self._bucket(self.length_edges, length)
        n = int(self.counts[i, j])
        # plain floats: the same IEEE operations as on the numpy scalars, without their overhead
        mean = seconds if n == 0 else (m := float(self.means[i, j])) + (seconds - m) / (n + 1)
        self.means[i, j] = mean
        self._rows[i][j] = float(mean)
        self.counts[i, j] = n + 1

    def lookup(self, batch_size: float, length: float) -> float:
        # hot path: plain floats (the same IEEE operations, in the same order, as on the numpy
        # cells), the four corners unrolled
        batch_memo, length_memo = self._positions
        bi, bw = batch_memo.get(batch_size) or self._remember(batch_memo, 0, batch_size)
        li, lw = length_memo.get(length) or self._remember(length_memo, 1, length)
        if self.interpolate:
            total = 0.0
            row = self._rows[bi]
            if w := (1 - bw) * (1 - lw):
                m = row[li]
                if m != m:              # NaN: an empty corner, fall back to the nearest filled cell
                    return self._nearest(bi + bw, li + lw)
                total += w * m
            if bw:
                up = self._rows[bi + 1]
                if w := bw * (1 - lw):
                    m = up[li]
                    if m != m:
                        return self._nearest(bi + bw, li + lw)
                    total += w * m
            if w := (1 - bw) * lw:
                m = row[li + 1]
                if m != m:
                    return self._nearest(bi + bw, li + lw)
                total += w * m
            if w := bw * lw:
                m = up[li + 1]
                if m != m:
                    return self._nearest(bi + bw, li + lw)
                total += w * m
            return total
        return self._nearest(bi + bw, li + lw)

    def _nearest(self, bi: float, li: float) -> float:
        """The filled cell nearest (L1 in grid steps) to the fractional grid position."""
        filled = ~np.isnan(self.means)
        if not filled.any():
            raise LookupError("StepTimeLUT is empty")
        target = (bi, li)
        cells = np.argwhere(filled)
        nearest = cells[np.argmin(np.abs(cells - np.asarray(target)).sum(axis=1))]
        return float(self.means[tuple(nearest)])

    def _remember(self, memo: dict, axis: int, value: float) -> tuple[int, float]:
        """:meth:`_position` of ``value`` on ``axis`` (0: batch, 1: length), kept in ``memo``."""
        pos = self._position(self.length_edges if axis else self.batch_edges, self._log_edges[axis], value)
        if len(memo) < 1 << 16:
            memo[value] = pos
        return pos

    @staticmethod
    def _position(edges: tuple[int, ...], log_edges: tuple[float, ...], value: float) -> tuple[int, float]:
        """Index of the grid point at or below ``value`` and the log2 weight of the next one."""
        if value <= edges[0] or len(edges) == 1:
            return 0, 0.0
        if value >= edges[-1]:
            return len(edges) - 2, 1.0
        i = bisect_right(edges, value) - 1
        lo, hi = log_edges[i], log_edges[i + 1]
        return i, (math.log2(value) - lo) / (hi - lo)

    @classmethod
    def from_cost_model(cls, model: CostModel, *, prior_count: int = 1, **edges) -> StepTimeLUT:
        """Fill every cell with the step time of a uniform batch at the cell's edges."""
        lut = cls(**edges)     # every cell at once (what ``set`` per cell gives, without its numpy scalars)
        lut._set_means(np.array([[model.decode_step_time([n] * b) for n in lut.length_edges]
                                 for b in lut.batch_edges], dtype=float))
        lut.counts[:] = prior_count
        return lut

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[int, int, float]], **edges) -> StepTimeLUT:
        lut = cls(**edges)
        for b, n, s in samples:
            lut.observe(b, n, s)
        return lut

    @classmethod
    def from_profile(cls, profile: Profile, **edges) -> StepTimeLUT:
        return cls.from_samples(((len(d.context_lens), max(d.context_lens), d.seconds)
                                 for d in profile.decode if d.context_lens), **edges)

    def to_dict(self) -> dict:
        return {"batch_edges": list(self.batch_edges), "length_edges": list(self.length_edges),
                "interpolate": self.interpolate,
                "means": [[None if math.isnan(v) else float(v) for v in row] for row in self.means],
                "counts": self.counts.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> StepTimeLUT:
        lut = cls(tuple(data["batch_edges"]), tuple(data["length_edges"]), bool(data["interpolate"]))
        lut._set_means(np.array([[np.nan if v is None else v for v in row] for row in data["means"]], float))
        lut.counts = np.asarray(data["counts"], dtype=np.int64)
        return lut


def prefill_features(batch: Sequence[tuple[int, int]], attention: str) -> list[float]:
    """Features of a prefill step's time, linear in its coefficients: ``(sum new, attention
    query-key pairs sum new*(cached+new/2), chunks, 1)``; a padded kernel pays every chunk as the
    longest one."""
    pairs = [(n, c) for n, c in batch if n > 0]
    if attention == "padded" and pairs:
        new, total = max(n for n, _ in pairs), max(n + c for n, c in pairs)
        attn = len(pairs) * new * (total - new / 2)
    else:
        attn = sum(n * (c + n / 2) for n, c in pairs)
    return [sum(n for n, _ in pairs), attn, len(pairs), 1.0]


def decode_features(context_lens: Sequence[int], attention: str) -> list[float]:
    """Features of a decode step's time: ``(batch, kv tokens, 1)`` with kv tokens ``sum(ctx)``
    (ragged) or ``batch * max(ctx)`` (padded)."""
    b = len(context_lens)
    kv = b * max(context_lens) if attention == "padded" else sum(context_lens)
    return [b, kv, 1.0]


class LinearStepModel:
    """Step times linear in :func:`prefill_features` / :func:`decode_features` with coefficients
    ``prefill_coef`` / ``decode_coef``: the fitted engine twin and the online learner
    (:class:`laneserve.policies.predictors.LearnedCostModel`). A mixed step is the prefill model over
    the chunks plus one ``(1, ctx-1)`` chunk per decode, never below the pure decode step."""

    attention: str
    prefill_coef: np.ndarray
    decode_coef: np.ndarray

    def prefill_time(self, batch: PrefillBatch) -> float:
        batch = list(batch)
        if not any(n > 0 for n, _ in batch):
            return 0.0
        return float(np.dot(self.prefill_coef, prefill_features(batch, self.attention)))

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        if not context_lens:
            return 0.0
        return float(np.dot(self.decode_coef, decode_features(context_lens, self.attention)))

    def mixed_step_time(self, prefill: PrefillBatch, context_lens: Sequence[int]) -> float:
        chunks = list(prefill) + [(1, max(c - 1, 0)) for c in context_lens]
        return max(self.prefill_time(chunks), self.decode_step_time(context_lens))


class FittedCostModel(LinearStepModel):
    """:class:`CostModel` fitted from an engine profile.

    prefill: non-negative weighted least squares of seconds over :func:`prefill_features`;
    decode: over :func:`decode_features`; mixed steps as :class:`LinearStepModel`.
    Operator times split the step by ``profile.op_fractions`` (evenly when absent). KV transfer
    fits ``profile.kv_copy`` for its link and uses ``links`` (H100 defaults) for the others.
    """

    def __init__(self, profile: Profile, *, links: dict[str, LinkSpec] | None = None) -> None:
        if not profile.prefill or not profile.decode:
            raise ValueError("a profile needs at least one prefill and one decode sample")
        self.profile = profile
        self.name = f"fitted:{profile.model}@{profile.device}"
        self.attention = profile.attention
        self.num_layers = profile.num_layers
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.prefill_coef = _fit_relative(
            np.array([prefill_features(list(zip(s.new_tokens, s.cached_tokens)), self.attention)
                      for s in profile.prefill]),
            np.array([s.seconds for s in profile.prefill]))
        self.decode_coef = _fit_relative(
            np.array([decode_features(d.context_lens, self.attention) for d in profile.decode]),
            np.array([d.seconds for d in profile.decode]))
        fractions = np.asarray(profile.op_fractions or [1.0] * len(LAYER_OPERATORS), float)
        if len(fractions) != len(LAYER_OPERATORS) or (fractions < 0).any() or fractions.sum() <= 0:
            raise ValueError(f"op_fractions must be {len(LAYER_OPERATORS)} non-negative numbers")
        self._op_share = np.tile(fractions / fractions.sum() / self.num_layers, self.num_layers)
        self.links = dict(links or H100_SXM.links)
        if len({s.tokens for s in profile.kv_copy}) >= 2:
            self.links[profile.kv_copy_link] = fit_link(
                (s.tokens * self.kv_bytes_per_token, s.seconds) for s in profile.kv_copy)

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        return (self.prefill_time(batch) * self._op_share).tolist()

    def kv_transfer_time(self, tokens: int, link: str = "nvlink") -> float:
        key = {"rdma": "infiniband", "ib": "infiniband"}.get(link.lower(), link.lower())
        if key not in self.links:
            raise ValueError(f"unknown link {link!r}; valid: {sorted(self.links) + ['rdma']}")
        return self.links[key].transfer_time(tokens * self.kv_bytes_per_token)


def _fit_relative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative error; columns constant across samples (other than
    the intercept, the last one) are dropped so they cannot trade off against the intercept."""
    keep = [i for i in range(features.shape[1] - 1) if np.ptp(features[:, i]) > 0]
    keep.append(features.shape[1] - 1)
    weights = 1.0 / np.maximum(seconds, 1e-12)
    coef = np.zeros(features.shape[1])
    coef[keep] = nnls(features[:, keep] * weights[:, None], seconds * weights)
    return coef
