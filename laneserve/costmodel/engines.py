"""Cost models of today's serving engines (vLLM, SGLang, TensorRT-LLM) beside the legacy analytic one.

:class:`~laneserve.costmodel.analytic.AnalyticCostModel` with its default constants is the model
the simulator has always used (calibrated on an HF-eager profile and Vidur's fused kernels; no
split-KV, NCCL all-reduce, per-layer launch cost). It stays the default and is unchanged:
``engine="legacy"``. :class:`EngineCostModel` is the same roofline skeleton (five operators a
layer, embedding and LM head folded in, tensor-parallel shards) with the kernels today's engines
run:

* **split-KV (flash-decoding) decode attention**: a request's KV is cut into up to ``max_splits``
  chunks so that ``batch * kv_heads * splits`` thread blocks fill the SMs; one step costs
  ``floor + per_request * batch + max(KV bytes / (bw * eff), key_s * longest / splits)``. A
  batch-1 decode over a long context no longer walks its keys in one block per head.
* **FlashAttention-3 prefill**: ``floor + sum_i flops_i / (peak * eff_max) * (1 + half / n_i)``
  (FLOPs of request ``i``'s ``n_i`` new tokens over its cached + causal keys; the efficiency ramps
  with the chunk length), never below reading the KV at the decode kernel's bandwidth.
* **custom all-reduce** (one-shot/two-shot over NVLink, CUDA-graph and eager variants) or NCCL:
  the measured latency curve of each, log-log interpolated in message size per GPU count; steps
  replayed from CUDA graphs use the graph variant.
* **fused element-wise kernels**: fused residual-add + RMSNorm twice a layer and the fused
  SiLU-and-multiply, each ``floor + elements * bytes / bw``; rotary is fused into attention, and
  there is no per-layer launch cost (CUDA graphs).
* GEMMs: the legacy roofline form with the engine's own fitted efficiency terms.

The constants come from aiconfigurator-core's per-operator measurements (NVIDIA, Apache-2.0; see
``data/NOTICE.md``): ``benchmarks/engine_tables.py`` derives two small CSVs from its tables
(operator-group step times of Llama-3.1-8B/70B and the measured all-reduce curves), and
:func:`laneserve.costmodel.engine_fit.fit_engines` fits ``data/engine_fits.json`` from them
(``python -m laneserve.costmodel.engine_fit``). Nothing here reads a parquet table or needs
aiconfigurator at run time.

``engine="laneserve"`` is this project's own engine: its GPU profile comes from ``laneserve
profile`` (``make_cost_model(..., engine="laneserve", profile=PATH)`` gives the fitted model of
that profile); without a profile it is the legacy analytic model, whose eager, unfused-kernel
calibration is the closest of the analytic ones to an engine without custom kernels.

GPUs: H100 SXM and H200 SXM have measured constants of their own. Another GPU (A100) reuses the
H100 constants with its own peaks, which is an *assumption* (no per-operator tables of it here).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .analytic import AnalyticCostModel
from .base import PrefillBatch
from .specs import HardwareSpec, ModelSpec

DATA = Path(__file__).resolve().parent / "data"
FITS_PATH = DATA / "engine_fits.json"
ALLREDUCE_PATH = DATA / "aiconfigurator_allreduce.csv"
STEPS_PATH = DATA / "aiconfigurator_steps.csv"

#: engine choices: the three measured engines, this project's engine, and the legacy constants
ENGINES = ("legacy", "vllm", "sglang", "trtllm", "laneserve")
MEASURED_ENGINES = ("vllm", "sglang", "trtllm")
#: laneserve hardware name -> aiconfigurator system name
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm"}
#: which measured all-reduce curve each engine's ``allreduce`` mode reads
ALLREDUCE_CURVES = {("vllm", "graph"): "vllm_custom_graph", ("vllm", "eager"): "vllm_custom_eager",
                    ("sglang", "graph"): "sglang_customallreduce_graph",
                    ("sglang", "eager"): "sglang_customallreduce_eager",
                    ("trtllm", "graph"): "trtllm", ("trtllm", "eager"): "trtllm"}
ALLREDUCE_MODES = ("auto", "graph", "eager", "nccl")
#: vLLM's default largest CUDA-graph capture size (tokens a step); larger steps run eagerly
GRAPH_MAX_TOKENS = 512


@dataclass(frozen=True)
class EngineConstants:
    """The fitted constants of one engine on one GPU (per layer, seconds; bytes per element)."""

    engine: str
    system: str
    gemm_efficiency_max: float
    gemm_half_tokens: float
    memory_efficiency: float
    gemm_overhead_s: float
    norm_floor_s: float
    norm_bytes_per_element: float
    act_floor_s: float
    act_bytes_per_element: float
    decode_attn_floor_s: float
    decode_attn_per_request_s: float
    decode_attn_efficiency: float
    decode_attn_key_s: float
    decode_attn_max_splits: int
    prefill_attn_floor_s: float
    prefill_attn_efficiency: float
    prefill_attn_half_tokens: float
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConstants:
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(**{k: v for k, v in d.items() if k in names},
                   extra={k: v for k, v in d.items() if k not in names})


@lru_cache(maxsize=1)
def load_fits(path: str = str(FITS_PATH)) -> dict[tuple[str, str], EngineConstants]:
    """The fitted constants by (engine, system)."""
    data = json.loads(Path(path).read_text())
    return {(d["engine"], d["system"]): EngineConstants.from_dict(d) for d in data["fits"]}


@lru_cache(maxsize=1)
def load_allreduce_curves(path: str = str(ALLREDUCE_PATH)) -> dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]]:
    """Measured all-reduce curves, (system, kernel, gpus) -> (log bytes, log seconds), sorted."""
    raw: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            raw.setdefault((r["system"], r["kernel"], int(r["num_gpus"])), []).append(
                (int(r["bytes"]), float(r["latency_ms"]) * 1e-3))
    out = {}
    for key, pts in raw.items():
        pts.sort()
        out[key] = (np.log([b for b, _ in pts]), np.log([s for _, s in pts]))
    return out


class AllReduceCurve:
    """One measured all-reduce curve: ``time(bytes)`` interpolated log-log between the measured
    sizes, the smallest size's time below them, and the last two points' bandwidth beyond."""

    def __init__(self, log_bytes: np.ndarray, log_s: np.ndarray, scale: float = 1.0) -> None:
        self.xs, self.ys, self.scale = log_bytes.tolist(), log_s.tolist(), scale
        x0, x1 = self.xs[-2], self.xs[-1]
        self._tail_bw = (math.exp(x1) - math.exp(x0)) / (math.exp(self.ys[-1]) - math.exp(self.ys[-2]))

    def time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        xs, ys = self.xs, self.ys
        x = math.log(nbytes)
        if x <= xs[0]:
            return math.exp(ys[0]) * self.scale
        if x >= xs[-1]:
            return (math.exp(ys[-1]) + (nbytes - math.exp(xs[-1])) / self._tail_bw) * self.scale
        i = int(np.searchsorted(xs, x))
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1])) * self.scale


def allreduce_curve(system: str, kernel: str, gpus: int) -> AllReduceCurve:
    """The measured curve of ``kernel`` among ``gpus`` GPUs of ``system`` (the next measured GPU
    count up when that one was not measured: 2, 4, 8)."""
    curves = load_allreduce_curves()
    counts = sorted(n for (s, k, n) in curves if s == system and k == kernel)
    if not counts:
        raise ValueError(f"no all-reduce measurements of {kernel!r} on {system!r}")
    n = next((c for c in counts if c >= gpus), counts[-1])
    return AllReduceCurve(*curves[(system, kernel, n)])


# --- the operator formulas (per layer, seconds), shared by the model and the fit -----------------

def gemm_times(c: EngineConstants, peak: float, bw: float, dtype: int, tokens, d_in, d_out):
    """GEMM of ``tokens`` rows with (already sharded) weights ``d_in x d_out`` (arrays or floats)."""
    flops = 2.0 * tokens * d_in * d_out
    nbytes = dtype * (d_in * d_out + tokens * (d_in + d_out))
    eff = c.gemm_efficiency_max * tokens / (tokens + c.gemm_half_tokens)
    return np.maximum(flops / (peak * eff), nbytes / (bw * c.memory_efficiency)) + c.gemm_overhead_s


def decode_splits(c: EngineConstants, num_sms: int, blocks):
    """Split-KV factor: enough splits for ``blocks`` (requests x KV heads) to fill the SMs, at
    most ``decode_attn_max_splits``."""
    return np.clip(num_sms // np.maximum(blocks, 1), 1, c.decode_attn_max_splits)


def decode_attention_times(c: EngineConstants, bw: float, num_sms: int, dtype: int, kv_local: int,
                           kv_heads_local: int, batch, kv_tokens, longest):
    """Split-KV decode attention of ``batch`` requests reading ``kv_tokens`` KV tokens in all,
    the longest ``longest`` (arrays or floats)."""
    splits = decode_splits(c, num_sms, batch * kv_heads_local)
    roofline = dtype * 2 * kv_local * kv_tokens / (bw * c.decode_attn_efficiency)
    walk = c.decode_attn_key_s * longest / splits
    return c.decode_attn_floor_s + c.decode_attn_per_request_s * batch + np.maximum(roofline, walk)


def prefill_attention_flops_term(q_local: int, new, cached):
    """``flops / (1 + half / new)`` pieces: (causal FLOPs, FLOPs / new) of one request's chunk."""
    flops = 4.0 * q_local * new * (cached + new / 2.0)
    return flops, flops / new


class EngineCostModel(AnalyticCostModel):
    """An :class:`AnalyticCostModel` with the kernels of a measured engine (``vllm``, ``sglang``
    or ``trtllm``) and that engine's fitted constants on ``hw``. ``allreduce``: ``auto`` (steps of
    at most :data:`GRAPH_MAX_TOKENS` tokens replay a CUDA graph and use the engine's graph custom
    all-reduce, larger ones its eager variant, or NCCL when that is faster), or one of ``graph`` /
    ``eager`` / ``nccl`` for every step."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int = 1, *, engine: str = "vllm",
                 attention: str = "ragged", host_overhead: bool = False, allreduce: str = "auto",
                 constants: EngineConstants | None = None) -> None:
        engine = engine.lower()
        if engine not in MEASURED_ENGINES:
            raise ValueError(f"EngineCostModel engine must be one of {MEASURED_ENGINES}, got {engine!r}")
        if allreduce not in ALLREDUCE_MODES:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_MODES}, got {allreduce!r}")
        self.engine, self.allreduce_mode = engine, allreduce
        self.system = SYSTEMS.get(hw.name, "h100_sxm")
        c = constants or load_fits()[(engine, self.system)]
        self.constants = c
        # the roofline skeleton's terms that the engine replaces: its GEMM efficiencies; no eager
        # extras, no per-layer launch cost (CUDA graphs)
        eng_hw = replace(hw, gemm_efficiency_max=c.gemm_efficiency_max,
                         gemm_half_tokens=c.gemm_half_tokens, memory_efficiency=c.memory_efficiency,
                         gemm_overhead_s=c.gemm_overhead_s, layer_overhead_s=0.0,
                         eager_bytes_per_element=0.0)
        super().__init__(model, eng_hw, tp=tp, attention=attention, host_overhead=host_overhead)
        self.name = f"{engine}:{model.name}@{hw.name}" + (f"-tp{tp}" if tp > 1 else "")
        self._kv_heads_local = max(model.num_kv_heads // tp, 1)
        # a GPU without measurements of its own (A100) reads the H100 curves: an assumption
        self._ar_graph = self._ar_eager = self._ar_nccl = None
        if tp > 1:
            self._ar_graph = allreduce_curve(self.system, ALLREDUCE_CURVES[(engine, "graph")], tp)
            self._ar_eager = allreduce_curve(self.system, ALLREDUCE_CURVES[(engine, "eager")], tp)
            self._ar_nccl = allreduce_curve(self.system, "nccl", tp)
        self._ar_cache: dict[float, float] = {}

    # --- the engine's kernels ---------------------------------------------------------------------

    def elementwise_times(self, tokens: float, *, eager: bool = True) -> dict[str, float]:
        """Fused residual-add + RMSNorm before attention and before the MLP, fused SiLU-and-mul
        after ``gate_up`` (rotary is inside the attention kernel)."""
        m, c, bw = self.model, self.constants, self.hw.hbm_bandwidth
        norm = c.norm_floor_s + tokens * m.hidden_size * c.norm_bytes_per_element / bw
        act = (c.act_floor_s + tokens * m.mlp_rows_per_token * (m.intermediate_size // self.tp)
               * c.act_bytes_per_element / bw)
        return {"qkv_proj": norm, "gate_up": norm, "down": act}

    def allreduce_time(self, tokens: float) -> float:
        if self._ar_graph is None or tokens <= 0:
            return 0.0
        t = self._ar_cache.get(tokens)
        if t is None:
            nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
            mode = self.allreduce_mode
            if mode == "graph" or (mode == "auto" and tokens <= GRAPH_MAX_TOKENS):
                t = self._ar_graph.time(nbytes)
            elif mode == "eager":
                t = self._ar_eager.time(nbytes)
            elif mode == "nccl":
                t = self._ar_nccl.time(nbytes)
            else:
                t = min(self._ar_eager.time(nbytes), self._ar_nccl.time(nbytes))
            if len(self._ar_cache) < 1 << 16:
                self._ar_cache[tokens] = t
        return t

    def nccl_allreduce_time(self, tokens: float) -> float:
        """The same all-reduce over NCCL (for comparison)."""
        if self._ar_nccl is None or tokens <= 0:
            return 0.0
        return self._ar_nccl.time(tokens * self.model.hidden_size * self.model.dtype_bytes)

    def _head_times(self, tokens: float, rows: int) -> tuple[float, float]:
        m, c = self.model, self.constants
        small = c.norm_floor_s + tokens * m.hidden_size * c.norm_bytes_per_element / self.hw.hbm_bandwidth
        embed = self.host_time(rows) + small + self.allreduce_time(tokens)
        head = small + self.gemm_time(rows, m.hidden_size, m.vocab_size)
        return embed, head

    def prefill_attention_time(self, batch: PrefillBatch) -> float:
        """FlashAttention-3 over the prefill chunks of one layer (causal over cached + new)."""
        pairs = self._prefill_pairs(batch)
        if not pairs:
            return 0.0
        c, hw = self.constants, self.hw
        work = 0.0
        for n, cached in pairs:
            flops, per_new = prefill_attention_flops_term(self._q_local, n, cached)
            work += flops + c.prefill_attn_half_tokens * per_new
        compute = work / (hw.peak_flops * c.prefill_attn_efficiency)
        kv = sum(n + cached for n, cached in pairs)
        memory = self.model.dtype_bytes * 2 * self._kv_local * kv / (hw.hbm_bandwidth * c.decode_attn_efficiency)
        return c.prefill_attn_floor_s + max(compute, memory)

    def _decode_terms(self, batch: int) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], bool]:
        terms = self._decode_attention_fns.get(batch)
        if terms is not None:
            return terms
        c, hw = self.constants, self.hw
        padded, dtype, kv_local = self.attention == "padded", self.model.dtype_bytes, self._kv_local
        splits = int(decode_splits(c, hw.num_sms, batch * self._kv_heads_local))
        byte_rate = hw.hbm_bandwidth * c.decode_attn_efficiency
        fixed = c.decode_attn_floor_s + c.decode_attn_per_request_s * batch
        key_s = c.decode_attn_key_s / splits

        def roofline(kv_tokens, maximum=max):
            return dtype * 2 * kv_local * kv_tokens / byte_rate

        def kernel(kv_tokens, longest, ceil=math.ceil, maximum=max):
            return key_s * longest

        def attention(total, longest, ceil=math.ceil, maximum=max):
            kv_tokens = batch * longest if padded else total
            return fixed + maximum(dtype * 2 * kv_local * kv_tokens / byte_rate, key_s * longest)

        terms = self._decode_attention_fns[batch] = (attention, roofline, kernel, False)
        return terms

    def decode_attention_time(self, context_lens: Sequence[int]) -> float:
        if not context_lens:
            return 0.0
        return self._decode_attention(len(context_lens))(sum(context_lens), max(context_lens))

    def decode_step_times(self, batch: int, total: int, longest: int, steps: int) -> list[float]:
        """:meth:`decode_step_time` of ``steps`` consecutive steps of the same batch, each a token
        longer per request (the same floats: the same operations, as arrays when there are many)."""
        fixed, layers = self._step_time(batch, 0.0, batch), self.num_layers
        attention = self._decode_terms(batch)[0]
        if steps < 24:
            return [fixed + layers * attention(total + batch * j, longest + j) for j in range(steps)]
        grown = np.arange(steps)
        return (fixed + layers * attention(total + batch * grown, longest + grown, np.ceil, np.maximum)).tolist()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decode_attention_fns": {}}

    def __repr__(self) -> str:
        return (f"EngineCostModel({self.model.name!r}, {self.hw.name!r}, tp={self.tp}, "
                f"engine={self.engine!r}, attention={self.attention!r}, allreduce={self.allreduce_mode!r})")


def make_engine_cost_model(model: ModelSpec, hw: HardwareSpec, tp: int = 1, *, engine: str = "legacy",
                           attention: str = "ragged", host_overhead: bool = False,
                           profile: str | None = None, allreduce: str = "auto"):
    """The cost model of ``engine``: ``legacy`` (and ``laneserve`` without a profile) is the
    unchanged :class:`AnalyticCostModel`; ``laneserve`` with ``profile`` the fitted model of that
    ``laneserve profile`` output; ``vllm``/``sglang``/``trtllm`` an :class:`EngineCostModel`."""
    engine = engine.lower()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if engine in ("legacy", "laneserve"):
        if engine == "laneserve" and profile is not None:
            from .fitted import FittedCostModel
            from .profile import check_profile_degree, load_profile
            return FittedCostModel(check_profile_degree(load_profile(profile), tp, str(profile)), links=dict(hw.links))
        return AnalyticCostModel(model, hw, tp=tp, attention=attention, host_overhead=host_overhead)
    return EngineCostModel(model, hw, tp=tp, engine=engine, attention=attention,
                           host_overhead=host_overhead, allreduce=allreduce)


def load_reference_steps(path: str | Path = STEPS_PATH) -> list[dict[str, Any]]:
    """aiconfigurator's composed step times (ms per operator group, all layers), one dict a row."""
    num = {"tp", "batch", "length"}
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.append({k: (int(v) if k in num else v if k in ("system", "backend", "version", "model", "phase")
                            else float(v)) for k, v in r.items()})
    return out
