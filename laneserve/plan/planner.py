"""Deployment planning: the cheapest layout that serves a workload within its SLOs.

A :class:`Layout` is one deployable cluster: a GPU type, colocated or disaggregated instances,
their counts and tensor-parallel degrees, a policy preset, a decode batch cap and a prefill chunk.
:func:`plan` searches them in two passes:

1. **Analytic bound** (:func:`bound`), microseconds per layout: the most requests per second one
   instance of each role can sustain on the workload's own prompt/output lengths under the cost
   model, with its TPOT target (the largest decode batch whose step meets it), its KV memory and
   its TTFT target (the target-percentile prompt's prefill must fit). It is optimistic (no
   queueing, perfect batching), so a layout whose bound misses the target rate (or, with a GPU
   budget, cannot beat a goodput already simulated) is pruned without simulating it.
2. **Simulation** of the survivors (:func:`evaluate`: the real trace, arrivals, SLO classes,
   policies, routers and KV memory), in parallel over processes or Ray tasks, cheapest first.

Two objectives: a target rate (``rate``: the fewest GPUs whose simulated attainment meets every
class's target at that rate) or a GPU budget (``budget``: the highest goodput, the largest rate
meeting the targets, found by a short bisection per layout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from laneserve.core import SLO
from laneserve.workloads import Workload
from laneserve.policies.spec import PolicySpec, as_spec, colocated_spec

#: tensor-parallel degrees tried by default
DEFAULT_TPS = (1, 2, 4, 8)
#: policy presets: disaggregated (prefill + decode) and colocated
DISAGG_PRESETS = ("adaptive", "fcfs", "cp-edf")
COLOCATED_PRESETS = ("colocated",)
PRESETS = DISAGG_PRESETS + COLOCATED_PRESETS
#: fewest KV tokens an instance must hold to be worth planning (a few of the longest requests)
MIN_KV_REQUESTS = 4


@dataclass(frozen=True)
class Layout:
    """One deployable cluster. Colocated: ``prefill`` instances of ``prefill_tp`` GPUs each."""

    gpu: str
    mode: str                  # "colocated" | "disaggregated"
    preset: str
    prefill: int
    prefill_tp: int
    decode: int = 0
    decode_tp: int = 0
    max_batch: int = 256
    chunk: int = 2048

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            shape = f"{self.prefill}x colocated TP{self.prefill_tp}"
        else:
            shape = f"{self.prefill}P TP{self.prefill_tp} + {self.decode}D TP{self.decode_tp}"
        return f"{self.gpu} {shape} [{self.preset}, batch<={self.max_batch}, chunk {self.chunk}]"

    def family(self) -> tuple:
        """Everything but the instance counts."""
        return (self.gpu, self.mode, self.preset, self.prefill_tp, self.decode_tp, self.max_batch, self.chunk)

    def policy_specs(self) -> tuple[str, str]:
        """(prefill policy spec, decode policy spec) of this layout's preset."""
        mb, ch = self.max_batch, self.chunk
        decode = f"continuous:max_batch_size={mb}"
        if self.preset == "adaptive":
            return f"adaptive:chunk={ch},token_budget={max(ch, 4096)}", f"adaptive:max_batch_size={mb}"
        if self.preset == "fcfs":
            return f"fcfs:token_budget={max(ch, 8192)}", decode
        if self.preset == "cp-edf":
            return f"cp-edf:chunk={ch}", decode
        if self.preset == "colocated":
            return f"cp-edf:chunk={ch}", decode
        raise ValueError(f"unknown preset {self.preset!r}; valid: {', '.join(PRESETS)}")

    def colocated_policy(self) -> PolicySpec:
        """The colocated policy of this layout, composed of its two typed halves."""
        p, d = self.policy_specs()
        return colocated_spec(as_spec("prefill", p), as_spec("decode", d), token_budget=self.chunk)

    def policy_label(self) -> str:
        p, d = self.policy_specs()
        if self.mode == "colocated":
            from laneserve.policies.registry import nested
            return f"colocated:prefill={nested(p)},decode={nested(d)},token_budget={self.chunk}"
        return f"{p}+{d}"


@dataclass
class PlanSpec:
    """What to plan for."""

    workload: Workload
    model: str
    gpus: Sequence[str] = ("h100",)
    engine: str | ProfiledEngine = "vllm"
    rate: float | None = None          # target rate (minimise GPUs)
    budget: int | None = None          # GPU budget (maximise goodput)
    target: float = 0.9                # attainment every class must reach (fraction meeting both SLOs)
    class_targets: dict[str, float] = field(default_factory=dict)
    tps: Sequence[int] = DEFAULT_TPS
    presets: Sequence[str] = PRESETS
    max_batches: Sequence[int] = (64, 256)
    chunks: Sequence[int] = (2048,)
    modes: Sequence[str] = ("colocated", "disaggregated")
    max_gpus: int = 64
    max_sims: int = 150
    router: str = "round-robin"
    kv_link: str = "nvlink"
    prune_slack: float = 1.0           # prune when bound * slack < the rate needed
    neighbours: int = 2                # counts tried above the bound's minimum, per role

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.budget is None):
            raise ValueError("give exactly one of rate (minimise GPUs) or budget (maximise goodput)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be > 0")
        if self.budget is not None and self.budget < 1:
            raise ValueError("budget must be >= 1 GPU")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")
        bad = [p for p in self.presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown preset(s) {bad}; valid: {', '.join(PRESETS)}")
        bad = [m for m in self.modes if m not in ("colocated", "disaggregated")]
        if bad:
            raise ValueError(f"unknown layout mode(s) {bad}; valid: colocated, disaggregated")

    def target_of(self, slo_class: str) -> float:
        return self.class_targets.get(slo_class, self.target)


# --- cost models ---------------------------------------------------------------------------------

_COSTS: dict[tuple, Any] = {}


@dataclass(frozen=True)
class ProfiledEngine:
    """The ``laneserve`` engine with measured profiles (``laneserve profile [-tp N]``): a degree a
    profile covers is charged on that profile's fitted model, whatever the GPU type (a profile
    times one device), its KV capacity and context still the analytic model's (a profile says
    nothing of a GPU's memory); the other degrees on the analytic model. Passed wherever an engine
    name goes (hashable, picklable: worker processes rebuild the models)."""

    profiles: tuple[tuple[int, str], ...]          # (degree, path), by degree
    name: str = "laneserve"

    @classmethod
    def of(cls, paths: Sequence[str]) -> ProfiledEngine:
        from laneserve.costmodel.profile import profiles_by_degree
        return cls(tuple(sorted(profiles_by_degree(paths).items())))

    def profile(self, tp: int) -> str | None:
        return dict(self.profiles).get(tp)

    def __str__(self) -> str:
        covered = ", ".join(f"TP{tp} {path}" for tp, path in self.profiles)
        return f"laneserve (profiles: {covered}; analytic for the other degrees)"


def cost_model(model: str, gpu: str, tp: int, engine: str | ProfiledEngine):
    """The (memoised) cost model of one instance."""
    key = (model, gpu, tp, engine)
    cm = _COSTS.get(key)
    if cm is None:
        from laneserve.costmodel import make_cost_model
        name = engine.name if isinstance(engine, ProfiledEngine) else engine
        cm = make_cost_model("analytic", model=model, hardware=gpu, tp=tp, engine=name)
        path = engine.profile(tp) if isinstance(engine, ProfiledEngine) else None
        if path is not None:
            analytic = cm
            cm = make_cost_model("analytic", model=model, hardware=gpu, tp=tp, engine=name, profile=path)
            cm.kv_capacity_tokens, cm.model = analytic.kv_capacity_tokens, analytic.model
        _COSTS[key] = cm
    return cm


def kv_tokens(cm) -> int | None:
    try:
        return int(cm.kv_capacity_tokens(0.9))
    except ValueError:
        return None


def layout_cost(layout: Layout, model: str, engine: str):
    """(cost model for the simulator, prefill KV tokens, decode KV tokens) of ``layout``."""
    from laneserve.costmodel.roles import RoleCostModel
    pre = cost_model(model, layout.gpu, layout.prefill_tp, engine)
    if layout.mode == "colocated":
        return pre, kv_tokens(pre), None
    dec = cost_model(model, layout.gpu, layout.decode_tp, engine)
    cm = pre if layout.prefill_tp == layout.decode_tp else RoleCostModel(pre, dec)
    return cm, kv_tokens(pre), kv_tokens(dec)


def cluster_config(layout: Layout, model: str, engine: str, *, router: str = "round-robin",
                   kv_link: str = "nvlink"):
    from laneserve.sim import ClusterConfig
    prefill_spec, decode_spec = layout.policy_specs()
    cm, kv_p, kv_d = layout_cost(layout, model, engine)
    if layout.mode == "colocated":
        cfg = ClusterConfig(mode="colocated", num_colocated=layout.prefill, router=router,
                            colocated_policy=layout.colocated_policy(), prefill_kv_tokens=kv_p,
                            decode_kv_tokens=kv_p, kv_link=kv_link)
    else:
        cfg = ClusterConfig(mode="disaggregated", num_prefill=layout.prefill, num_decode=layout.decode,
                            prefill_policy=prefill_spec, decode_policy=decode_spec, router=router,
                            prefill_kv_tokens=kv_p, decode_kv_tokens=kv_d, kv_link=kv_link)
    return cfg, cm


# --- the analytic bound --------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadShape:
    """What the bound reads of a workload: lengths, each request's TTFT target, and per class the
    request indices and the tightest TPOT target."""

    prompts: np.ndarray
    outputs: np.ndarray
    ttfts: np.ndarray                        # inf where a request has none
    classes: dict[str, tuple[np.ndarray, float | None]]

    @classmethod
    def of(cls, wl: Workload) -> WorkloadShape:
        prompts = np.array([s.prompt_len for s in wl.specs])
        outputs = np.array([s.output_len for s in wl.specs])
        ttfts = np.array([s.slo.ttft if s.slo.ttft is not None else np.inf for s in wl.specs])
        classes = {}
        for name in sorted({s.slo_class for s in wl.specs}):
            idx = np.array([i for i, s in enumerate(wl.specs) if s.slo_class == name])
            tpots = [wl.specs[i].slo.tpot for i in idx if wl.specs[i].slo.tpot is not None]
            classes[name] = (idx, min(tpots) if tpots else None)
        return cls(prompts, outputs, ttfts, classes)

    def class_slos(self) -> dict[str, SLO]:
        """One SLO per class (the tightest TTFT and TPOT of its requests), for display."""
        out = {}
        for name, (idx, tpot) in self.classes.items():
            ttft = float(self.ttfts[idx].min())
            out[name] = SLO(ttft if np.isfinite(ttft) else None, tpot)
        return out


def _prefill_cost(cm, prompt: int, chunk: int) -> float:
    """A request's share of prefill time when prompts are batched up to ``chunk`` tokens."""
    if prompt >= chunk:
        return cm.prefill_time([(prompt, 0)])
    return prompt * cm.prefill_time([(chunk, 0)]) / chunk


def _decode_batch(cm, batch_cap: int, context: int, tpot: float | None, kv: int | None,
                  per_request_kv: float) -> tuple[int, float]:
    """(largest decode batch meeting ``tpot`` within ``batch_cap`` and KV memory, its step time)."""
    from laneserve.costmodel.base import decode_summary_time
    cap = batch_cap
    if kv is not None:
        cap = min(cap, int(kv // max(per_request_kv, 1.0)))
    if cap < 1:
        return 0, math.inf

    def step(b: int) -> float:
        return decode_summary_time(cm, b, b * context, context)

    if tpot is None or step(cap) <= tpot:
        return cap, step(cap)
    if step(1) > tpot:
        return 0, math.inf
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step(mid) <= tpot:
            lo = mid
        else:
            hi = mid - 1
    return lo, step(lo)


@dataclass(frozen=True)
class Bound:
    """Per-instance capacities (req/s) of a layout's family and whether its TTFT can be met."""

    prefill_rate: float          # per prefill (or colocated) instance
    decode_rate: float           # per decode instance (colocated: folded into prefill_rate)
    feasible: bool
    why: str = ""

    def rate(self, layout: Layout) -> float:
        if not self.feasible:
            return 0.0
        if layout.mode == "colocated":
            return layout.prefill * self.prefill_rate
        return min(layout.prefill * self.prefill_rate, layout.decode * self.decode_rate)


def bound(layout: Layout, shape: WorkloadShape, spec: PlanSpec) -> Bound:
    """The optimistic per-instance capacities of ``layout``'s family on ``shape`` (see the module
    docstring). Classes with different targets: the tightest TPOT sets the decode batch, every
    class's target-percentile prompt must prefill within its TTFT."""
    pre = cost_model(spec.model, layout.gpu, layout.prefill_tp, spec.engine)
    dec = pre if layout.mode == "colocated" else cost_model(spec.model, layout.gpu, layout.decode_tp, spec.engine)
    kv_p, kv_d = kv_tokens(pre), kv_tokens(dec)
    longest = int(shape.prompts.max() + shape.outputs.max())
    if kv_p is None or kv_d is None:
        return Bound(0.0, 0.0, False, "model does not fit")
    if min(kv_p, kv_d) < MIN_KV_REQUESTS * longest // 4:
        return Bound(0.0, 0.0, False, "KV memory too small")
    for name, (idx, _) in shape.classes.items():
        # alone on an idle instance, enough of the class must prefill within its TTFT
        uniq, inverse = np.unique(shape.prompts[idx], return_inverse=True)
        alone = np.array([pre.prefill_time([(int(p), 0)]) for p in uniq])[inverse]
        if np.mean(alone <= shape.ttfts[idx]) < spec.target_of(name):
            return Bound(0.0, 0.0, False, f"class {name}: too many prompts cannot prefill within TTFT")
    chunk = layout.chunk
    uniq, counts = np.unique(shape.prompts, return_counts=True)
    prefill_s = float(sum(c * _prefill_cost(pre, int(p), chunk) for p, c in zip(uniq, counts)) / len(shape.prompts))
    tpots = [tpot for _, tpot in shape.classes.values() if tpot is not None]
    tpot = min(tpots) if tpots else None
    mean_out = float(shape.outputs.mean())
    context = int(shape.prompts.mean() + mean_out / 2)
    per_req_kv = float(shape.prompts.mean() + mean_out)
    if layout.mode == "colocated":
        # a step of b decodes plus a chunk of prefill must meet the TPOT target
        b, step = _decode_batch(pre, layout.max_batch, context, tpot, kv_p, per_req_kv)
        if b == 0:
            return Bound(0.0, 0.0, False, "no decode batch meets TPOT")
        decode_s = mean_out * step / b
        return Bound(1.0 / (prefill_s + decode_s), 0.0, True)
    b, step = _decode_batch(dec, layout.max_batch, context, tpot, kv_d, per_req_kv)
    if b == 0:
        return Bound(0.0, 0.0, False, "no decode batch meets TPOT")
    return Bound(1.0 / prefill_s, b / (step * mean_out), True)


# --- enumeration ---------------------------------------------------------------------------------

def fits(model: str, gpu: str, tp: int, engine: str) -> bool:
    from laneserve.costmodel import get_model_spec
    m = get_model_spec(model)
    if m.num_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads):
        return False
    return kv_tokens(cost_model(model, gpu, tp, engine)) is not None


def families(spec: PlanSpec) -> list[Layout]:
    """One layout per family (counts 1) over the search space."""
    out = []
    for gpu in spec.gpus:
        tps = [tp for tp in spec.tps if fits(spec.model, gpu, tp, spec.engine)]
        for mb in spec.max_batches:
            for chunk in spec.chunks:
                if "colocated" in spec.modes and "colocated" in spec.presets:
                    for tp in tps:
                        out.append(Layout(gpu, "colocated", "colocated", 1, tp, max_batch=mb, chunk=chunk))
                if "disaggregated" in spec.modes:
                    for preset in (p for p in spec.presets if p in DISAGG_PRESETS):
                        for tpp in tps:
                            for tpd in tps:
                                out.append(Layout(gpu, "disaggregated", preset, 1, tpp, 1, tpd,
                                                  max_batch=mb, chunk=chunk))
    return out


def _count_layouts(fam: Layout, gpus: int) -> int:
    """Layouts of ``fam``'s family within ``gpus`` GPUs."""
    if fam.mode == "colocated":
        return gpus // fam.prefill_tp
    return sum((gpus - p * fam.prefill_tp) // fam.decode_tp for p in range(1, gpus // fam.prefill_tp + 1))


def _shrunk(lay: Layout) -> list[Layout]:
    """``lay`` with one instance fewer of a role (at least one of each)."""
    if lay.mode == "colocated":
        return [replace(lay, prefill=lay.prefill - 1)] if lay.prefill > 1 else []
    out = []
    if lay.prefill > 1:
        out.append(replace(lay, prefill=lay.prefill - 1))
    if lay.decode > 1:
        out.append(replace(lay, decode=lay.decode - 1))
    return out


def _layouts_within(spec: PlanSpec, gpus: int) -> int:
    """Every layout of the search space within ``gpus`` GPUs."""
    return sum(_count_layouts(fam, gpus) for fam in families(spec))


def candidates_for_rate(spec: PlanSpec, shape: WorkloadShape) -> tuple[list[tuple[Layout, float]], int]:
    """(layouts whose bound reaches the target rate, with their bound; number of layouts within
    ``max_gpus`` the bound ruled out: infeasible families, and the counts below each family's
    bound minimum)."""
    rate = spec.rate / spec.prune_slack
    out, pruned = [], 0
    for fam in families(spec):
        b = bound(fam, shape, spec)
        if not b.feasible:
            pruned += _count_layouts(fam, spec.max_gpus)
            continue
        if fam.mode == "colocated":
            n0 = max(1, math.ceil(rate / b.prefill_rate))
            counts = [(n, 0) for n in range(n0, n0 + spec.neighbours + 1)]
        else:
            p0 = max(1, math.ceil(rate / b.prefill_rate))
            d0 = max(1, math.ceil(rate / b.decode_rate))
            counts = [(p, d) for p in range(p0, p0 + spec.neighbours) for d in range(d0, d0 + spec.neighbours + 1)]
        # every smaller count within max_gpus is ruled out by the bound without a simulation
        if fam.mode == "colocated":
            pruned += min(n0 - 1, spec.max_gpus // fam.prefill_tp)
        else:
            for p in range(1, spec.max_gpus // fam.prefill_tp + 1):
                room = (spec.max_gpus - p * fam.prefill_tp) // fam.decode_tp
                pruned += room if p < p0 else min(room, d0 - 1)
        for p, d in counts:
            lay = replace(fam, prefill=p, decode=d if fam.mode != "colocated" else 0)
            if lay.gpus > spec.max_gpus:
                continue
            out.append((lay, b.rate(lay)))
    out.sort(key=lambda x: (x[0].gpus, -x[1]))
    return out, pruned


def candidates_for_budget(spec: PlanSpec, shape: WorkloadShape) -> tuple[list[tuple[Layout, float]], int]:
    """(maximal layouts within the GPU budget, with their bound goodput, best first; number pruned)."""
    out, pruned = [], 0
    g = spec.budget
    for fam in families(spec):
        b = bound(fam, shape, spec)
        if not b.feasible:
            pruned += 1 if fam.mode == "colocated" else g // fam.prefill_tp
            continue
        if fam.mode == "colocated":
            n = g // fam.prefill_tp
            if n >= 1:
                out.append((replace(fam, prefill=n), b.rate(replace(fam, prefill=n))))
            continue
        for p in range(1, g // fam.prefill_tp + 1):
            d = (g - p * fam.prefill_tp) // fam.decode_tp
            if d < 1:
                break
            lay = replace(fam, prefill=p, decode=d)
            out.append((lay, b.rate(lay)))
    out.sort(key=lambda x: (-x[1], x[0].gpus))
    return out, pruned


# --- simulation ----------------------------------------------------------------------------------

def attainment(summary: dict[str, Any], spec_targets: dict[str, float], default: float) -> tuple[bool, float, dict]:
    """(every class meets its target, worst class's margin over its target, per-class attainment)."""
    per = {name: (c["attainment_both"] or 0.0) for name, c in (summary.get("per_class") or {}).items()}
    if not per:
        per = {"default": summary.get("attainment_both") or 0.0}
    margins = [a - spec_targets.get(name, default) for name, a in per.items()]
    return min(margins) >= 0, min(margins), per


def evaluate(workload: Workload, layout: Layout, model: str, engine: str, rate: float,
             targets: dict[str, float], default_target: float, router: str = "round-robin",
             kv_link: str = "nvlink") -> dict[str, Any]:
    """Simulate ``layout`` at ``rate`` and summarise it (a module-level function: worker processes)."""
    from laneserve.measure.simulate import run_point
    cfg, cm = cluster_config(layout, model, engine, router=router, kv_link=kv_link)
    summary, _ = run_point(workload, cfg, cm, rate=rate)
    ok, margin, per = attainment(summary, targets, default_target)
    return {"rate": rate, "meets": ok, "margin": margin, "attainment_both": summary["attainment_both"],
            "per_class": per, "request_goodput": summary["request_goodput"],
            "p90_ttft_ms": summary.get("p90_ttft_ms"), "p90_tpot_ms": summary.get("p90_tpot_ms"),
            "p99_ttft_ms": summary.get("p99_ttft_ms"), "sim_wall_seconds": summary.get("sim_wall_seconds")}


def goodput_of(workload: Workload, layout: Layout, model: str, engine: str, hint: float,
               targets: dict[str, float], default_target: float, router: str = "round-robin",
               kv_link: str = "nvlink", evals: int = 7, rel_tol: float = 0.05) -> dict[str, Any]:
    """The highest rate at which ``layout`` meets every class's target: geometric steps from
    ``hint / 2`` (the bound halved) up to ``4 * hint``, then bisection (``measure.search``); when
    even ``hint / 2`` misses, the same from ``hint / 16``. At most ``evals`` simulations."""
    from laneserve.measure.search import goodput_search
    seen: dict[float, dict[str, Any]] = {}

    def f(rate: float) -> float:
        r = seen[rate] = evaluate(workload, layout, model, engine, rate, targets, default_target,
                                  router, kv_link)
        return default_target + r["margin"]        # >= default_target exactly when every class meets

    res = goodput_search(f, lo=hint / 2, hi=4 * hint, target=default_target, rel_tol=rel_tol,
                         max_evals=evals, growth=1.5)
    used = res.evals
    if not res.met and used < evals:
        res = goodput_search(f, lo=hint / 16, hi=hint / 2, target=default_target, rel_tol=rel_tol,
                             max_evals=evals - used, growth=2.0)
        used += res.evals
    if res.met:
        out = dict(seen[res.value])
        out["goodput"] = res.value
    else:
        low = seen[min(seen)]
        out = {**low, "rate": 0.0, "meets": False, "request_goodput": 0.0, "goodput": 0.0}
    out["sims"] = used
    out["saturated"] = res.saturated
    return out


@dataclass
class PlanResult:
    spec: PlanSpec
    ranked: list[dict[str, Any]]         # simulated layouts, best first
    winner: dict[str, Any] | None
    considered: int                      # layouts in the search space (rate: within max_gpus)
    pruned: int                          # layouts ruled out without a simulation (bound, order)
    simulated: int
    simulations: int                     # simulator runs
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"winner": self.winner, "ranked": self.ranked, "considered": self.considered,
                "pruned": self.pruned, "simulated": self.simulated, "simulations": self.simulations,
                "search_seconds": self.seconds}


def _row(layout: Layout, bound_rate: float, res: dict[str, Any], spec: PlanSpec) -> dict[str, Any]:
    rate = res["rate"]
    good = res.get("goodput", rate if res["meets"] else 0.0)
    return {"layout": layout.label, "gpu": layout.gpu, "mode": layout.mode, "preset": layout.preset,
            "prefill": layout.prefill, "prefill_tp": layout.prefill_tp, "decode": layout.decode,
            "decode_tp": layout.decode_tp, "max_batch": layout.max_batch, "chunk": layout.chunk,
            "gpus": layout.gpus, "bound_rate": bound_rate, "rate": rate, "meets": res["meets"],
            "attainment_both": res["attainment_both"], "worst_margin": res["margin"],
            "per_class": res["per_class"], "goodput": good,
            "goodput_per_gpu": (res.get("request_goodput") or 0.0) / layout.gpus if spec.rate is not None
            else good / layout.gpus,
            "p90_ttft_ms": res.get("p90_ttft_ms"), "p90_tpot_ms": res.get("p90_tpot_ms"),
            "sims": res.get("sims", 1), "_layout": asdict(layout)}


def rank_key(row: dict[str, Any], spec: PlanSpec) -> tuple:
    """Sort key of a simulated layout, best first. Target rate: layouts meeting every class's
    target first, then fewer GPUs, then the larger worst-class margin and goodput per GPU. GPU
    budget: the higher goodput, then fewer GPUs, then the larger margin."""
    if spec.rate is not None:
        return (not row["meets"], row["gpus"], -row["worst_margin"], -row["goodput_per_gpu"])
    return (-row["goodput"], row["gpus"], -row["worst_margin"])


def simulated_row(spec: PlanSpec, layout: Layout, rate: float | None = None) -> dict[str, Any]:
    """A layout simulated at ``rate`` (default: the spec's) as a ranked-table row."""
    shape = WorkloadShape.of(spec.workload)
    targets = {name: spec.target_of(name) for name in shape.classes}
    res = evaluate(spec.workload, layout, spec.model, spec.engine, rate or spec.rate, targets,
                   spec.target, spec.router, spec.kv_link)
    b = bound(layout, shape, spec).rate(layout)
    return _row(layout, b, res, spec)


def plan(spec: PlanSpec, *, jobs: Any = 1, progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Search the layouts of ``spec`` (see the module docstring); ``jobs``: processes or a
    :class:`~laneserve.measure.parallel.RayWorkers`; ``progress(done, total)`` after each batch."""
    import time

    from laneserve.measure.parallel import RayWorkers
    t0 = time.perf_counter()
    shape = WorkloadShape.of(spec.workload)
    targets = {name: spec.target_of(name) for name in shape.classes}
    width = jobs.num_cpus if isinstance(jobs, RayWorkers) and hasattr(jobs, "num_cpus") else (
        jobs if isinstance(jobs, int) else 4)
    batch = max(2, 2 * width)
    search = _search_for_rate if spec.rate is not None else _search_for_budget
    rows, considered, pruned, sims = search(spec, shape, targets, batch, jobs, progress)
    rows.sort(key=lambda r: rank_key(r, spec))
    winner = rows[0] if rows and (rows[0]["meets"] or spec.budget is not None and rows[0]["goodput"] > 0) else None
    return PlanResult(spec, rows, winner, considered, pruned, len(rows), sims, time.perf_counter() - t0)


def _search_for_rate(spec: PlanSpec, shape: WorkloadShape, targets: dict[str, float], batch: int, jobs: Any,
                     progress: Callable[[int, int], None] | None) -> tuple[list[dict[str, Any]], int, int, int]:
    """A target rate: simulate the layouts cheapest first (fewest GPUs, then the highest bound),
    trying the smaller neighbours of each that meets, until nothing as cheap as the best is left.
    (rows, layouts considered, pruned, simulator runs)."""
    from laneserve.measure.parallel import map_jobs
    rows: list[dict[str, Any]] = []
    sims = 0
    cands, _ = candidates_for_rate(spec, shape)
    considered = _layouts_within(spec, spec.max_gpus)
    bounds = {lay: b for lay, b in cands}
    pending = sorted(bounds, key=lambda lay: (lay.gpus, -bounds[lay]))
    seen = set(pending)
    best_gpus = None
    done = 0
    while pending and done < spec.max_sims:
        if best_gpus is not None:
            pending = [lay for lay in pending if lay.gpus <= best_gpus]
            if not pending:
                break                   # every layout as cheap as the best has been simulated
        take, pending = pending[:min(batch, spec.max_sims - done)], pending[min(batch, spec.max_sims - done):]
        tasks = [(spec.workload, lay, spec.model, spec.engine, spec.rate, targets, spec.target,
                  spec.router, spec.kv_link) for lay in take]
        results = map_jobs(evaluate, tasks, jobs)
        sims += len(tasks)
        done += len(tasks)
        grown = []
        for lay, res in zip(take, results):
            rows.append(_row(lay, bounds[lay], res, spec))
            if res["meets"]:
                if best_gpus is None or lay.gpus < best_gpus:
                    best_gpus = lay.gpus
                # the bound is a steady-state estimate: a layout that meets may still have
                # room, so its one-instance-smaller neighbours are tried too
                for smaller in _shrunk(lay):
                    if smaller not in seen:
                        seen.add(smaller)
                        bounds[smaller] = bounds[lay] * (smaller.gpus / lay.gpus)
                        grown.append(smaller)
        pending = sorted(pending + grown, key=lambda lay: (lay.gpus, -bounds[lay]))
        if progress is not None:
            progress(done, min(spec.max_sims, done + len(pending)))
    return rows, considered, considered - done, sims


def _search_for_budget(spec: PlanSpec, shape: WorkloadShape, targets: dict[str, float], batch: int, jobs: Any,
                       progress: Callable[[int, int], None] | None) -> tuple[list[dict[str, Any]], int, int, int]:
    """A GPU budget: search each layout's goodput in the order of its bound, pruning those whose
    (scaled) bound cannot beat the best goodput found. (rows, layouts considered, pruned, simulator runs)."""
    from laneserve.measure.parallel import map_jobs
    rows: list[dict[str, Any]] = []
    sims = 0
    cands, pruned = candidates_for_budget(spec, shape)
    considered = len(cands) + pruned
    best_good = 0.0
    i, done = 0, 0
    budget = min(len(cands), spec.max_sims)
    # the bound is a steady-state estimate; on a finite workload a layout can beat it: prune by
    # the bound scaled by the largest goodput / bound ratio simulated so far (x 1.1)
    ratio = 1.0
    while i < len(cands) and done < spec.max_sims:
        scale = ratio * 1.1 * spec.prune_slack
        if cands[i][1] * scale <= best_good:
            pruned += len(cands) - i     # sorted by bound: nothing later can beat it
            break
        window = cands[i:i + min(batch, spec.max_sims - done)]
        chunk = [c for c in window if c[1] * scale > best_good]
        pruned += len(window) - len(chunk)
        tasks = [(spec.workload, lay, spec.model, spec.engine, b * ratio, targets, spec.target,
                  spec.router, spec.kv_link) for lay, b in chunk]
        results = map_jobs(goodput_of, tasks, jobs)
        for (lay, b), res in zip(chunk, results):
            sims += res["sims"]
            rows.append(_row(lay, b, res, spec))
            best_good = max(best_good, res["goodput"])
            if b > 0:
                ratio = max(ratio, res["goodput"] / b)
        i += len(window)
        done += len(chunk)
        if progress is not None:
            progress(min(done, budget), budget)
    return rows, considered, pruned, sims


def layout_of(row: dict[str, Any]) -> Layout:
    return Layout(**row["_layout"])


def attainment_curve(spec: PlanSpec, layout: Layout, rates: Sequence[float], jobs: Any = 1) -> list[dict[str, Any]]:
    """The simulated attainment of ``layout`` at each rate (overall and per class)."""
    from laneserve.measure.parallel import map_jobs
    shape = WorkloadShape.of(spec.workload)
    targets = {name: spec.target_of(name) for name in shape.classes}
    tasks = [(spec.workload, layout, spec.model, spec.engine, r, targets, spec.target, spec.router,
              spec.kv_link) for r in rates]
    return map_jobs(evaluate, tasks, jobs)


def serve_command(layout: Layout, spec: PlanSpec, *, model_path: str = "<CHECKPOINT>") -> dict[str, Any]:
    """The ``laneserve serve`` command line deploying ``layout`` (with each role's TP degree), its
    device assignment and Ray placement (on Ray each TP instance gets one placement group of its
    GPUs, built by the cluster: the ``ray start`` line only names the instances' resources)."""
    import shlex
    prefill_spec, decode_spec = layout.policy_specs()
    cm = cost_model(spec.model, layout.gpu, layout.decode_tp or layout.prefill_tp, spec.engine)
    kv = kv_tokens(cm) or 65536
    shape = WorkloadShape.of(spec.workload)
    args = ["laneserve", "serve", "--model", model_path]
    if layout.mode == "colocated":
        args += ["--colocated", "--prefill", str(layout.prefill)]
        n_inst, roles = layout.prefill, [("colocated", layout.prefill, layout.prefill_tp)]
    else:
        args += ["--prefill", str(layout.prefill), "--decode", str(layout.decode)]
        n_inst = layout.prefill + layout.decode
        roles = [("prefill", layout.prefill, layout.prefill_tp), ("decode", layout.decode, layout.decode_tp)]
    args += _tp_flags(roles)
    args += ["--prefill-policy", prefill_spec, "--decode-policy", decode_spec, "--router-policy", spec.router]
    devices, g, placement = [], 0, []
    for role, count, tp in roles:
        for _ in range(count):
            devices.append(f"cuda:{g}")
            placement.append({"role": role, "tp": tp, "gpus": list(range(g, g + tp))})
            g += tp
    args += ["--devices", ",".join(devices[:n_inst]), "--kv-tokens", str(kv),
             "--max-num-batched-tokens", str(layout.chunk), "--cuda-graphs"]
    for name, slo in shape.class_slos().items():
        parts = [f"ttft_ms={slo.ttft * 1e3:g}" if slo.ttft is not None else None,
                 f"tpot_ms={slo.tpot * 1e3:g}" if slo.tpot is not None else None]
        body = ",".join(p for p in parts if p)
        if not body:
            continue
        if len(shape.classes) == 1:
            args += ["--default-slo", body]
        else:
            args += ["--slo-class", f"{name}:{body}"]
    counts = {}
    for role, count, _ in roles:
        counts[f"laneserve_{role}"] = count
    import json
    ray = [f"ray start --head --resources '{json.dumps(counts)}'",
           " ".join(shlex.quote(a) for a in args) + " --ray-address auto"]
    return {"command": " ".join(shlex.quote(a) for a in args), "argv": args, "placement": placement,
            "ray": ray}


def _tp_flags(roles: list[tuple[str, int, int]]) -> list[str]:
    """The serve flags giving each role its planned TP degree: ``-tp N`` when every instance has
    the same degree (colocated instances always take it), else one flag per role; none at TP1.
    Each instance's ``--devices`` entry is its first GPU: its ranks take that GPU and the next."""
    degrees = {role: tp for role, _, tp in roles}
    if set(degrees.values()) == {1}:
        return []
    if len(set(degrees.values())) == 1:
        return ["--tensor-parallel-size", str(next(iter(degrees.values())))]
    return [a for role, tp in degrees.items() for a in (f"--{role}-tensor-parallel-size", str(tp))]
