"""Analytic (roofline) cost model: one replica of a :class:`ModelSpec` on a :class:`HardwareSpec`
(DESIGN.md, "Cost models"; LAPS §2.1's compute/memory split, FlowPrefill §4's operator boundaries).

Each layer is the five operators of :data:`LAYER_OPERATORS`. An operator's time is

* its GEMM: ``max(flops / (peak * eff(tokens)), bytes / (bw * mem_eff)) + gemm_overhead`` where the
  weights are read once per step and ``eff`` ramps with the number of rows;
* plus its small kernels (norm and rotary in ``qkv_proj``, the second norm in ``gate_up``, the
  activation in ``down``) as HBM traffic, ``elements * elementwise_bytes_per_element / bw``;
* plus, for ``attention``, the causal attention of the prefill chunks (FLOPs
  ``4 * heads * head_dim * new * (cached + new/2)``, KV of cached + new tokens read) and the decode
  attention (KV of every context read; ``ragged`` pays ``sum(ctx)``, ``padded`` pays
  ``batch * max(ctx)``);
* plus, with tensor parallelism, an all-reduce after ``o_proj`` and after ``down``;
* plus ``layer_overhead_s / 5`` of fixed launch cost.

The embedding is folded into the first operator, the final norm and the LM head (last token of each
prefill request, every decode request) into the last. The efficiency terms are the calibrated ones
recorded in :mod:`laneserve.costmodel.specs` (rerun :mod:`laneserve.costmodel.calibrate`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import LAYER_OPERATORS, PrefillBatch
from .specs import HardwareSpec, ModelSpec

ATTENTION_KINDS = ("ragged", "padded")


class AnalyticCostModel:
    """Roofline latency model implementing :class:`~laneserve.costmodel.base.CostModel`."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int = 1,
                 attention: str = "ragged") -> None:
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if tp < 1 or model.num_heads % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide num_heads={model.num_heads}")
        self.model, self.hw, self.tp, self.attention = model, hw, tp, attention
        self.name = f"analytic:{model.name}@{hw.name}" + (f"-tp{tp}" if tp > 1 else "")
        self.num_layers = model.num_layers
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._q_local = model.q_dim // tp
        self._kv_local = max(model.num_kv_heads // tp, 1) * model.head_dim
        self._op_overhead = hw.layer_overhead_s / len(LAYER_OPERATORS)
        self._fixed_cache: dict[tuple[float, int], float] = {}

    # --- building blocks (per layer, seconds) ----------------------------------------------------

    def gemm_time(self, tokens: float, d_in: int, d_out: int, *, split_out: bool = True) -> float:
        """One tensor-parallel GEMM of ``tokens`` rows, weights ``d_in x d_out`` sharded over tp
        (column-parallel when ``split_out``, row-parallel otherwise)."""
        if tokens <= 0:
            return 0.0
        hw, dtype = self.hw, self.model.dtype_bytes
        local_in, local_out = (d_in, d_out // self.tp) if split_out else (d_in // self.tp, d_out)
        flops = 2.0 * tokens * local_in * local_out
        nbytes = dtype * (local_in * local_out + tokens * (local_in + local_out))
        compute = flops / (hw.peak_flops * hw.gemm_efficiency(tokens))
        memory = nbytes / (hw.hbm_bandwidth * hw.memory_efficiency)
        return max(compute, memory) + hw.gemm_overhead_s

    def linear_op_times(self, tokens: float) -> dict[str, float]:
        """The GEMM part of each linear operator of one layer."""
        m = self.model
        return {"qkv_proj": self.gemm_time(tokens, m.hidden_size, m.q_dim + 2 * m.kv_dim),
                "o_proj": self.gemm_time(tokens, m.q_dim, m.hidden_size, split_out=False),
                "gate_up": self.gemm_time(tokens, m.hidden_size, m.gate_up_params // m.hidden_size),
                "down": self.gemm_time(tokens, m.intermediate_size, m.hidden_size, split_out=False)}

    def elementwise_times(self, tokens: float) -> dict[str, float]:
        """Norms, rotary and activation of one layer, keyed by the operator they are folded in."""
        m, per_elem = self.model, self.hw.elementwise_bytes_per_element / self.hw.hbm_bandwidth
        rope = (self._q_local + self._kv_local) if m.rope else 0
        return {"qkv_proj": tokens * (m.hidden_size + rope) * per_elem,
                "gate_up": tokens * m.hidden_size * per_elem,
                "down": tokens * (m.intermediate_size // self.tp) * per_elem}

    def prefill_attention_time(self, batch: PrefillBatch) -> float:
        """Causal attention of prefill chunks in one layer (new tokens attend to cached + new)."""
        pairs = [(n, c) for n, c in batch if n > 0]
        if not pairs:
            return 0.0
        if self.attention == "padded":
            new, total = max(n for n, _ in pairs), max(n + c for n, c in pairs)
            pairs = [(new, total - new)] * len(pairs)
        dtype, hw = self.model.dtype_bytes, self.hw
        query_pairs = sum(n * (c + n / 2) for n, c in pairs)
        flops = 4.0 * self._q_local * query_pairs
        kv_read = sum(n + c for n, c in pairs) * 2 * self._kv_local
        q_o = sum(n for n, _ in pairs) * (2 * self._q_local + 2 * self._kv_local)
        nbytes = dtype * (kv_read + q_o)
        return max(flops / (hw.peak_flops * hw.attention_efficiency),
                   nbytes / (hw.hbm_bandwidth * hw.memory_efficiency))

    def decode_attention_time(self, context_lens: Sequence[int]) -> float:
        """One query per request over its whole KV; memory-bound on the KV bytes."""
        if not context_lens:
            return 0.0
        kv_tokens = (len(context_lens) * max(context_lens) if self.attention == "padded"
                     else sum(context_lens))
        dtype, hw = self.model.dtype_bytes, self.hw
        nbytes = dtype * (kv_tokens * 2 * self._kv_local
                          + len(context_lens) * 2 * (self._q_local + self._kv_local))
        flops = 4.0 * self._q_local * kv_tokens
        return max(flops / (hw.peak_flops * hw.attention_efficiency),
                   nbytes / (hw.hbm_bandwidth * hw.memory_efficiency))

    def allreduce_time(self, tokens: float) -> float:
        if self.tp == 1 or tokens <= 0:
            return 0.0
        link = self.hw.link("nvlink")
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
        return link.latency + 2 * (self.tp - 1) / self.tp * nbytes / link.bandwidth

    def _layer_ops(self, tokens: float, attention_s: float) -> list[float]:
        lin, elem, ar = self.linear_op_times(tokens), self.elementwise_times(tokens), self.allreduce_time(tokens)
        ov = self._op_overhead
        return [lin["qkv_proj"] + elem["qkv_proj"] + ov,
                attention_s + ov,
                lin["o_proj"] + ar + ov,
                lin["gate_up"] + elem["gate_up"] + ov,
                lin["down"] + elem["down"] + ar + ov]

    def _head_times(self, tokens: float, rows: int) -> tuple[float, float]:
        """(embedding, final norm + LM head) for a step of ``tokens`` tokens and ``rows`` logits."""
        m = self.model
        per_elem = self.hw.elementwise_bytes_per_element / self.hw.hbm_bandwidth
        embed = tokens * m.hidden_size * per_elem
        head = tokens * m.hidden_size * per_elem + self.gemm_time(rows, m.hidden_size, m.vocab_size)
        return embed, head

    def _step_ops(self, tokens: float, attention_s: float, rows: int) -> list[float]:
        if tokens <= 0:
            return [0.0] * (self.num_layers * len(LAYER_OPERATORS))
        layer = self._layer_ops(tokens, attention_s)
        ops = layer * self.num_layers
        embed, head = self._head_times(tokens, rows)
        ops[0] += embed
        ops[-1] += head
        return ops

    def _step_time(self, tokens: float, attention_s: float, rows: int) -> float:
        if tokens <= 0:
            return 0.0
        # everything but attention depends on (tokens, rows) alone: memoised, since a simulation
        # asks for the same decode batch sizes millions of times
        key = (tokens, rows)
        fixed = self._fixed_cache.get(key)
        if fixed is None:
            embed, head = self._head_times(tokens, rows)
            fixed = self.num_layers * sum(self._layer_ops(tokens, 0.0)) + embed + head
            if len(self._fixed_cache) < 1 << 16:
                self._fixed_cache[key] = fixed
        return fixed + self.num_layers * attention_s

    # --- CostModel protocol ----------------------------------------------------------------------

    def prefill_time(self, batch: PrefillBatch) -> float:
        batch = list(batch)
        tokens = sum(n for n, _ in batch)
        return self._step_time(tokens, self.prefill_attention_time(batch), len(batch))

    def graphed_prefill_time(self, batch: PrefillBatch) -> float:
        """A prefill step replayed from a captured CUDA graph: the per-layer launch cost of the
        small kernels (``layer_overhead_s``) disappears; GEMM, attention and element-wise work
        stay. This assumes the calibrated layer overhead is CPU launch time, as its definition
        says (HF-eager-like profile); a fused engine would gain less."""
        t = self.prefill_time(batch)
        return t - self.num_layers * self.hw.layer_overhead_s if t > 0 else t

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        batch = list(batch)
        tokens = sum(n for n, _ in batch)
        return self._step_ops(tokens, self.prefill_attention_time(batch), len(batch))

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        return self._step_time(len(context_lens), self.decode_attention_time(context_lens),
                               len(context_lens))

    def mixed_step_time(self, prefill: PrefillBatch, context_lens: Sequence[int]) -> float:
        prefill = list(prefill)
        tokens = sum(n for n, _ in prefill) + len(context_lens)
        attention = self.prefill_attention_time(prefill) + self.decode_attention_time(context_lens)
        return self._step_time(tokens, attention, len(prefill) + len(context_lens))

    def kv_transfer_time(self, tokens: int, link: str = "nvlink") -> float:
        """Each of the tp ranks ships its shard of the KV over its own link, in parallel."""
        return self.hw.link(link).transfer_time(tokens * self.kv_bytes_per_token / self.tp)

    def kv_capacity_tokens(self, utilization: float = 0.9) -> int:
        """KV tokens that fit on one instance (``tp`` GPUs): memory at ``utilization`` minus the
        weights, divided by the KV bytes of one token."""
        free = self.hw.memory_bytes * utilization * self.tp - self.model.params * self.model.dtype_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit in {self.tp}x {self.hw.name} memory")
        return int(free // self.kv_bytes_per_token)

    def __repr__(self) -> str:
        return f"AnalyticCostModel({self.model.name!r}, {self.hw.name!r}, tp={self.tp}, attention={self.attention!r})"
