"""Where the SLO-aware policies' predictors come from ("honest predictors": a policy does not read the cost model that charges the time).

FlowPrefill's TTFT polynomial, LAPS' long-chunk estimate, Kairos prefill's ``estimate="cost"`` and
Kairos decode's step table all read a cost model bound with
:meth:`~laneserve.policies.base.InstanceScheduler.bind_cost_model`. Which one is a run choice
(``ClusterConfig.predictor``, ``laneserve sim --predictor``), made by :class:`PredictorSource`:

- ``online`` (default): each instance gets its own :class:`LearnedCostModel`, which starts from a
  generic prior and learns from the step times the instance observes (the runtime feeds it every
  completed step, :meth:`LearnedCostModel.observe`). Nothing of the run's cost model is read.
- ``oracle``: the run's own cost model, the one that charges the time: perfect predictions (the
  earlier behaviour, kept for comparison and for paper reproductions).
- ``profile``: a :class:`~laneserve.costmodel.FittedCostModel` fitted once, before the run, to an
  offline profile of the same model and hardware (:func:`profile_cost_model`): a fixed grid of
  prefill and decode batches timed on the run's cost model, each time multiplied by an independent
  log-normal factor ``exp(N(0, 0.1²))`` (seed 0, ~10 % measurement noise), then fitted by the
  engine twin's linear model — so it carries noise and model-form error, as a real profile would.

:class:`LearnedCostModel` is the engine twin's linear step model
(:class:`~laneserve.costmodel.fitted.LinearStepModel`) with coefficients fitted online: non-negative
least squares of relative error over a running Gram matrix (O(1) per observation), refitted in
epochs — after observation 1, 2, 4, 8, … then every :data:`MAX_EPOCH` — so the amortised cost per
step stays O(1). Before any observation it predicts the prior: a deliberately conservative linear
model (prefill 10 ms + 0.1 ms per token, i.e. 10K tokens/s; decode 10 ms + 0.1 ms per request +
50 ns per KV token; on a ragged kernel the decode model also has a term in the longest context,
:func:`learned_decode_features`, which the prior leaves at 0), a few pseudo-samples of which stay
in the fit with weight :data:`PRIOR_WEIGHT` each (they only decide directions the observations do not span).
``prefill_version`` / ``decode_version`` count the refits; policies that cache predictions re-read
them when they change, without re-predicting their whole queue in one decision (S-EDF's queue
re-keys only the requests a refit can move, Kairos re-times its columns in vectorised passes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np

from laneserve.core.plan import StepPlan
from laneserve.costmodel.fitted import FittedCostModel, LinearStepModel, prefill_features
from laneserve.costmodel.laps_fit import nnls
from laneserve.costmodel.profile import synthesize_profile

PREDICTORS = ("online", "oracle", "profile")

#: the generic prior: prefill (s/token, s/query-key pair, s/chunk, s/step), decode (s/request,
#: s/KV token, s/step)
PRIOR_PREFILL = (1e-4, 0.0, 0.0, 0.01)
PRIOR_DECODE = (1e-4, 5e-8, 0.01)
#: ragged kernels: the same with the longest context's term (none in the prior)
PRIOR_DECODE_RAGGED = (1e-4, 5e-8, 0.0, 0.01)
_PRIOR_PREFILL_BATCHES = ([(16, 0)], [(256, 0)], [(4096, 0)], [(512, 0)] * 4, [(2048, 6144)])
_PRIOR_DECODE_BATCHES = ([256], [2048] * 16, [512] * 128)
PRIOR_WEIGHT = 0.05
MAX_EPOCH = 256            # observations between refits once the doubling reaches it

# feature scales: keep the Gram matrix well conditioned (tokens ~1e3, query-key pairs ~1e6)
_PREFILL_SCALE = np.array([1e3, 1e6, 1.0, 1.0])
_DECODE_SCALE = np.array([1e2, 1e5, 1.0])
_DECODE_SCALE_RAGGED = np.array([1e2, 1e5, 1e4, 1.0])


def learned_decode_features(batch: int, total: int, longest: int, attention: str) -> list[float]:
    """The online learner's decode features of a step of ``batch`` requests whose contexts sum to
    ``total``, the longest ``longest``: :func:`~laneserve.costmodel.fitted.decode_features`, and
    on a ragged kernel the longest context too (``(batch, kv tokens, longest, 1)``). A ragged
    kernel reads a batch's total KV, but one request's attention runs on the blocks of its own
    heads, so a single long context sets a floor under the step that the total alone does not
    show (Llama-3.1-8B/H100: one 64K-token request makes a 31-request step 63 ms, 31 requests of
    1K tokens take 10 ms)."""
    if attention == "padded":
        return [batch, batch * longest, 1.0]
    return [batch, total, longest, 1.0]


class _OnlineFit:
    """Relative-error NNLS ``min Σ w ((x·β − s) / s)²`` over a running Gram matrix, refitted in
    doubling epochs."""

    def __init__(self, scale: np.ndarray, prior: Sequence[tuple[list[float], float]]) -> None:
        self.scale = scale
        self._inv_scale = [1.0 / v for v in scale]
        k = len(scale)
        self.gram = [[0.0] * k for _ in range(k)]       # plain floats: an update is ~k² adds
        self.rhs = [0.0] * k
        self.observations = 0
        self.version = 0
        self._next_refit = 1
        for x, seconds in prior:
            self._add(x, seconds, PRIOR_WEIGHT)
        self.coef = self._solve()

    def _add(self, x: Sequence[float], seconds: float, weight: float) -> None:
        row = [v * s / seconds for v, s in zip(x, self._inv_scale)]
        for i, a in enumerate(row):
            wa = weight * a
            self.rhs[i] += wa
            g = self.gram[i]
            for j, b in enumerate(row):
                g[j] += wa * b

    def add(self, x: Sequence[float], seconds: float) -> bool:
        """Fold in one observation; True when it triggered a refit."""
        self._add(x, seconds, 1.0)
        self.observations += 1
        if self.observations < self._next_refit:
            return False
        self._next_refit = self.observations + min(self.observations, MAX_EPOCH)
        self.coef = self._solve()
        self.version += 1
        return True

    def _solve(self) -> np.ndarray:
        # ||Rβ − R⁻ᵀh||² = βᵀGβ − 2βᵀh + const with G = RᵀR: NNLS on the Cholesky factor
        gram, rhs = np.array(self.gram), np.array(self.rhs)
        lower = np.linalg.cholesky(gram + 1e-12 * np.trace(gram) * np.eye(len(rhs)))
        beta = nnls(lower.T, np.linalg.solve(lower, rhs))
        return beta / self.scale


class LearnedCostModel(LinearStepModel):
    """A cost model the instance learns online from its own steps (see the module docstring).
    ``attention`` is the decode kernel kind (a configuration fact, not a timing)."""

    def __init__(self, attention: str = "ragged") -> None:
        self.attention = attention
        self.name = "learned"
        self._prefill = _OnlineFit(_PREFILL_SCALE, [(prefill_features(b, attention), _prior_prefill(b, attention))
                                                    for b in _PRIOR_PREFILL_BATCHES])
        self._decode = _OnlineFit(_DECODE_SCALE if attention == "padded" else _DECODE_SCALE_RAGGED,
                                  [(_summary_features(b, attention), _prior_decode(b, attention))
                                   for b in _PRIOR_DECODE_BATCHES])

    @property
    def prefill_coef(self) -> np.ndarray:
        return self._prefill.coef

    @property
    def decode_coef(self) -> np.ndarray:
        return self._decode.coef

    @property
    def prefill_version(self) -> int:
        return self._prefill.version

    @property
    def decode_version(self) -> int:
        return self._decode.version

    @property
    def observations(self) -> int:
        return self._prefill.observations + self._decode.observations

    def observe_prefill(self, batch: Sequence[tuple[int, int]], seconds: float) -> bool:
        if seconds <= 0 or not any(n > 0 for n, _ in batch):
            return False
        return self._prefill.add(prefill_features(batch, self.attention), seconds)

    def observe_decode(self, context_lens: Sequence[int], seconds: float) -> bool:
        if not context_lens:
            return False
        return self.observe_decode_summary(len(context_lens), sum(context_lens), max(context_lens), seconds)

    def observe_decode_summary(self, batch: int, total: int, longest: int, seconds: float) -> bool:
        """:meth:`observe_decode` of a step given by its request count, context sum and longest."""
        if seconds <= 0 or batch <= 0:
            return False
        return self._decode.add(learned_decode_features(batch, total, longest, self.attention), seconds)

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        if not context_lens:
            return 0.0
        return self.decode_summary_time(len(context_lens), sum(context_lens), max(context_lens))

    def decode_summary_time(self, batch: int, total: int, longest: int) -> float:
        """A decode step of ``batch`` requests whose contexts sum to ``total``, the longest ``longest``."""
        if batch <= 0:
            return 0.0
        return float(np.dot(self._decode.coef, learned_decode_features(batch, total, longest, self.attention)))

    def observe(self, plan: StepPlan, seconds: float) -> bool:
        """One completed step (call before the scheduler advances the counters). Left out: steps
        with swaps (their copies are charged too), graph-replayed shape buckets, and steps resumed
        after a preemption (only their remainder was timed). A mixed step counts as a prefill of
        its chunks plus one 1-token chunk per decode (the linear model's mixed rule)."""
        if plan.swap_in or plan.swap_out or plan.padded_shape is not None or plan.ops_done:
            return False
        if plan.prefills:
            batch = [(c.num_new_tokens, c.start) for c in plan.prefills]
            batch += [(1, max(r.context_len - 1, 0)) for r in plan.decodes]
            return self.observe_prefill(batch, seconds)
        return self.observe_decode([r.context_len for r in plan.decodes], seconds)

    def ttft_polynomial(self) -> tuple[float, float, float]:
        """``(c0, c1, c2)``: one request of ``n`` new tokens on an empty cache takes
        ``c0 + c1 n + c2 n²`` (non-negative coefficients, so non-decreasing in ``n``)."""
        per_token, pairs, per_chunk, per_step = self.prefill_coef
        return float(per_chunk + per_step), float(per_token), float(pairs / 2)

    def __repr__(self) -> str:
        return f"LearnedCostModel({self.attention}, {self.observations} observations)"


def _prior_prefill(batch: list[tuple[int, int]], attention: str) -> float:
    return float(np.dot(PRIOR_PREFILL, prefill_features(batch, attention)))


def _summary_features(context_lens: list[int], attention: str) -> list[float]:
    return learned_decode_features(len(context_lens), sum(context_lens), max(context_lens), attention)


def _prior_decode(context_lens: list[int], attention: str) -> float:
    prior = PRIOR_DECODE if attention == "padded" else PRIOR_DECODE_RAGGED
    return float(np.dot(prior, _summary_features(context_lens, attention)))


class LearnedTTFT:
    """FlowPrefill's TTFT predictor read from a :class:`LearnedCostModel`: a quadratic in the token
    count, re-read when the model refits (``version``). ``observe`` feeds the model (the policy's
    own learner, when no instance runtime feeds one)."""

    __slots__ = ("model", "_version", "_c0", "_c1", "_c2")

    def __init__(self, model: LearnedCostModel | None = None) -> None:
        self.model = model or LearnedCostModel()
        self._version = -1
        self._c0 = self._c1 = self._c2 = 0.0

    @property
    def version(self) -> int:
        return self.model.prefill_version

    def observe(self, tokens: int, seconds: float) -> None:
        self.model.observe_prefill([(tokens, 0)], seconds)

    def coefficients(self) -> tuple[float, float, float]:
        """``(c0, c1, c2)`` of the current fit, as :meth:`__call__` evaluates them:
        ``c0 + n * (c1 + n * c2)``."""
        if self._version != self.model.prefill_version:
            self._version = self.model.prefill_version
            self._c0, self._c1, self._c2 = self.model.ttft_polynomial()
        return self._c0, self._c1, self._c2

    def __call__(self, tokens: float) -> float:
        if self._version != self.model.prefill_version:
            self._version = self.model.prefill_version
            self._c0, self._c1, self._c2 = self.model.ttft_polynomial()
        return self._c0 + tokens * (self._c1 + tokens * self._c2)


# ---- the offline profile ------------------------------------------------------------------------
PROFILE_NOISE = 0.1
PROFILE_SEED = 0


@lru_cache(maxsize=8)
def profile_cost_model(cost: Any, *, noise: float = PROFILE_NOISE, seed: int = PROFILE_SEED) -> FittedCostModel:
    """The ``profile`` predictor: the engine twin's fit to a noisy synthetic profile of ``cost``
    (single prompts of 16..32K tokens, 2K chunks after 1K..64K cached tokens, batches of 2-8
    prompts; decode batches of 1..256 requests at 128..32K tokens of context). Memoised per cost
    model object (a goodput search builds many simulators on one)."""
    prefill = [[(2**k, 0)] for k in range(4, 16)]
    prefill += [[(2048, 2**k)] for k in range(10, 17, 2)]
    prefill += [[(n, 0)] * b for b in (2, 4, 8) for n in (128, 512, 2048)]
    decode = [[n] * 2**b for b in range(0, 9) for n in (128, 512, 2048, 8192, 32768)]
    profile = synthesize_profile(cost, prefill, decode, device="profile")
    rng = np.random.default_rng(seed)
    profile.prefill = [replace(s, seconds=s.seconds * math.exp(rng.normal(0.0, noise))) for s in profile.prefill]
    profile.decode = [replace(s, seconds=s.seconds * math.exp(rng.normal(0.0, noise))) for s in profile.decode]
    return FittedCostModel(profile)


class PredictorSource:
    """The model each instance's policy reads its predictions from, for one run (``mode`` in
    :data:`PREDICTORS`). :meth:`for_instance` returns ``(model, learner)``: the model to bind, and
    the learner the instance runtime must feed (``online`` only; else None)."""

    def __init__(self, mode: str, cost: Any) -> None:
        if mode not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {mode!r}")
        self.mode = mode
        self.cost = cost
        self._profile = profile_cost_model(cost) if mode == "profile" else None

    def for_instance(self) -> tuple[Any, LearnedCostModel | None]:
        if self.mode == "oracle":
            return self.cost, None
        if self.mode == "profile":
            return self._profile, None
        learner = LearnedCostModel(attention=getattr(self.cost, "attention", "ragged"))
        return learner, learner
