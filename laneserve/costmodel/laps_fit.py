"""LAPS §2.1: the compute/memory boundary of (re-)prefills.

T_comp(L, H) = alpha * L * (L + 2H) + beta * L     (attention and FFN compute)
T_mem(L, H)  = gamma_w * L + gamma_r * H           (KV write of the new tokens, read of history)
               + gamma_0                            (our addition, see below)

The boundary L_m is where the two are equal (the paper equates them): for a first prefill
``L_m = max(0, (gamma_w - beta) / alpha)``; for a re-prefill over H history tokens the positive
root of ``alpha L^2 + (2 alpha H + beta - gamma_w) L - gamma_r H = 0``. Below L_m a prefill is
memory-bound ("short"), above it compute-bound ("long"). The time of a prefill is taken as the
roofline ``max(T_comp, T_mem)`` (the regime that dominates).

Deviation from the paper, on purpose: ``gamma_0`` is a fixed memory time per step (streaming the
weights once, launch overheads). Without it a real prefill curve - flat at small L, where the step
is bound by the weight read, then rising - is fitted by a line through the origin and L_m lands
far off (thousands of tokens for Llama-3-8B on H100). With it the boundary is the positive root of
``alpha L^2 + (2 alpha H + beta - gamma_w) L - (gamma_r H + gamma_0) = 0``, which is the paper's
formula when ``gamma_0 = 0`` (``fit(..., intercept=False)`` fits the paper's model exactly).

The paper fits the two curves from samples of (T_comp, T_mem, L, H). An engine only observes the
total T, so :meth:`LapsPrefillModel.fit` fits the max model by alternating assignment: label each
sample with the regime that currently predicts the larger time, refit each regime by non-negative
least squares on its samples, repeat; several initial splits by L, keep the best.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns, by enumerating the passive set: the NNLS
    optimum is the unconstrained solution on some subset of columns that is itself feasible."""
    n = a.shape[1]
    best, best_x = math.inf, np.zeros(n)
    for mask in range(1, 2**n):
        cols = [i for i in range(n) if mask >> i & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        residual = float(np.sum((a[:, cols] @ x - b) ** 2))
        if residual < best * (1 - 1e-12):
            best, best_x = residual, np.zeros(n)
            best_x[cols] = x
    return best_x


@dataclass(slots=True)
class LapsPrefillModel:
    alpha: float = 0.0
    beta: float = 0.0
    gamma_w: float = 0.0
    gamma_r: float = 0.0
    gamma_0: float = 0.0
    #: L_m used until a fit exists (LAPS' configured default).
    default_boundary: float = 256.0
    fitted: bool = False

    def t_comp(self, new_tokens: float, history: float = 0.0) -> float:
        return self.alpha * new_tokens * (new_tokens + 2 * history) + self.beta * new_tokens

    def t_mem(self, new_tokens: float, history: float = 0.0) -> float:
        return self.gamma_w * new_tokens + self.gamma_r * history + self.gamma_0

    def predict(self, new_tokens: float, history: float = 0.0) -> float:
        return max(self.t_comp(new_tokens, history), self.t_mem(new_tokens, history))

    def boundary(self, history: float = 0.0) -> float:
        """L_m for ``history`` cached tokens (L_m^prefill at 0, L_m^re-prefill otherwise)."""
        if not self.fitted or self.alpha <= 0:
            return self.default_boundary
        a, h = self.alpha, history
        b = 2 * a * h + self.beta - self.gamma_w
        return max(0.0, (-b + math.sqrt(b * b + 4 * a * (self.gamma_r * h + self.gamma_0))) / (2 * a))

    def classify(self, new_tokens: int, cached: int = 0) -> str:
        return "short" if new_tokens < self.boundary(cached) else "long"

    def fit(self, samples: Iterable[tuple[float, float, float]], *, intercept: bool = True,
            iterations: int = 50) -> LapsPrefillModel:
        """Fit alpha, beta, gamma_w, gamma_r (and gamma_0 when ``intercept``) to (L, H, T)
        samples, minimising the relative squared error."""
        data = np.asarray(list(samples), dtype=float)
        if len(data) < 4:
            raise ValueError("need at least 4 (L, H, T) samples")
        length, history, seconds = data[:, 0], data[:, 1], data[:, 2]
        w = 1.0 / np.maximum(seconds, 1e-12)
        comp_x = np.column_stack([length * (length + 2 * history), length]) * w[:, None]
        mem_cols = [length, history] + ([np.ones_like(length)] if intercept else [])
        mem_x = np.column_stack(mem_cols) * w[:, None]
        target = seconds * w

        def fit_split(is_comp: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
            comp = nnls(comp_x[is_comp], target[is_comp]) if is_comp.any() else np.zeros(2)
            mem = (nnls(mem_x[~is_comp], target[~is_comp]) if (~is_comp).any()
                   else np.zeros(mem_x.shape[1]))
            tc, tm = comp_x @ comp, mem_x @ mem
            return float(np.sum((np.maximum(tc, tm) - target) ** 2)), comp, mem, tc >= tm

        work = length * (length + 2 * history)
        best = (math.inf, np.zeros(2), np.zeros(mem_x.shape[1]))
        for threshold in np.unique(np.quantile(work, np.linspace(0, 1, 11))):
            is_comp = work >= threshold
            for _ in range(iterations):
                loss, comp, mem, relabel = fit_split(is_comp)
                if loss < best[0]:
                    best = (loss, comp, mem)
                if (relabel == is_comp).all():
                    break
                is_comp = relabel
        _, comp, mem = best
        self.alpha, self.beta = float(comp[0]), float(comp[1])
        self.gamma_w, self.gamma_r = float(mem[0]), float(mem[1])
        self.gamma_0 = float(mem[2]) if intercept else 0.0
        self.fitted = True
        return self

    @classmethod
    def from_cost_model(cls, model, lengths: Sequence[int] = tuple(2**k for k in range(3, 14)),
                        histories: Sequence[int] = (0, 1024, 4096, 16384)) -> LapsPrefillModel:
        """Fit to a cost model's single-request prefill times on an (L, H) grid."""
        return cls().fit((n, h, model.prefill_time([(n, h)])) for n in lengths for h in histories)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LapsPrefillModel:
        return cls(**data)
