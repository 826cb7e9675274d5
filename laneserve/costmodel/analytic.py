"""Analytic (roofline) cost model: one replica of a :class:`ModelSpec` on a :class:`HardwareSpec`
(docs/design.md, "Cost models"; LAPS §2.1's compute/memory split, FlowPrefill §4's operator boundaries).

Each layer is the five operators of :data:`LAYER_OPERATORS`. An operator's time is

* its GEMM: ``max(flops / (peak * eff(tokens)), bytes / (bw * mem_eff)) + gemm_overhead`` where the
  weights are read once per step and ``eff`` ramps with the number of rows;
* plus its small kernels (norm and rotary in ``qkv_proj``, the second norm in ``gate_up``, the
  activation and residual add in ``down``), each ``kernel_floor_s`` plus its HBM traffic,
  ``elements * elementwise_bytes_per_element / bw`` (fitted on Vidur's fused vLLM kernels);
* plus, for ``attention``, one FlashAttention kernel for the prefill chunks and one for the
  decodes (:meth:`AnalyticCostModel.attention_kernel_time`): the larger of the roofline (prefill
  FLOPs ``4 * heads * head_dim * new * (cached + new/2)`` at ``attention_efficiency``; the KV bytes
  read once per KV head at HBM bandwidth, a lower bound that always holds) and the thread-block
  schedule (blocks walk their keys serially one tile at a time, in waves over the SMs, so batch-1
  decode over a long context is bound by one block's walk — no split-KV), plus a per-kernel floor.
  Prefill launches a block per 128 query rows and query head. Decode launches, per request, a block
  per *KV head* that serves the query heads of its group together (``decode_kernel="gqa_packed"``,
  the default: FlashInfer's decode, FlashAttention's packed-GQA decode path) or a block per *query
  head* (``"per_query_head"``: the kernel LLMServingSim profiled, see
  :mod:`laneserve.costmodel.calibrate`). ``ragged`` (varlen) gives each request its own keys;
  ``padded`` pads every request to the longest (``batch * max(ctx)``);
* plus, with tensor parallelism, an all-reduce after ``o_proj`` and after ``down`` (2 per layer,
  Megatron-style) and one for the vocab-parallel embedding, each
  ``max(floor, latency + bytes / bandwidth)`` as fitted to the DGX all-reduce profile for that
  number of GPUs;
* plus what an eager engine adds (fitted on LLMServingSim's HF-eager profile): the extra traffic of
  its unfused small kernels (``eager_bytes_per_element``) and ``layer_overhead_s / 5`` of fixed
  launch cost (dropped under CUDA-graph replay); ``layer_time(..., launch=False)`` is the
  fused-kernel GPU time alone, as Vidur's per-operator profiles measure it.

With ``host_overhead=True`` every step also pays the host's CPU cost of an iteration
(``HardwareSpec.host``: schedule, input preparation, sampling, output processing, worker messaging
with TP > 1) by number of sequences. It is off by default (GPU time only): folded into a step's
first operator it lengthens what a FlowPrefill preemption must wait for, and the policy's
suspension accounting does not know it yet (tests/test_prefill_flowprefill.py's bound is exceeded
by ~10 ms with it on). An MoE layer runs its ``experts_per_token``
routed experts per token and reads the weights of every expert the batch touches.

The embedding and the host cost are folded into the first operator, the final norm and the LM head
(last token of each prefill request, every decode request) into the last. The constants are the
calibrated ones in :mod:`laneserve.costmodel.fitted_constants` (re-run ``laneserve calibrate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .base import LAYER_OPERATORS, PrefillBatch
from .specs import HardwareSpec, ModelSpec

ATTENTION_KINDS = ("ragged", "padded")
#: Decode-attention kernels, by the thread blocks one request launches per layer.
#: ``gqa_packed``: one per KV head, its block loading each KV tile once for all the query heads of
#: the group. *Assumption* (the default): no profile we have measured such a kernel; a block's cost
#: per key tile is taken to be the fitted one of a one-query-head block (the tile's HBM load
#: dominates; a few more query rows on the tensor cores are nearly free), so packing only cuts the
#: block count by the group size and, saturated, the kernel streams the KV at about HBM bandwidth.
#: ``per_query_head``: one per query head, each re-reading its group's KV (vLLM's paged-attention
#: kernel has this grid; the LLMServingSim sample's kernel too: its time steps up every
#: 132 / 16 = 8.25 requests at 16 query heads per GPU, not every 66 as 2 KV heads would give).
DECODE_KERNELS = ("gqa_packed", "per_query_head")
#: query rows per FlashAttention thread block
ATTN_BLOCK_ROWS = 128
#: runs of decode steps at least this long are timed with numpy arrays (its call overhead is
#: about that of 20 scalar steps)
_ARRAY_STEPS = 24


class AnalyticCostModel:
    """Roofline latency model implementing :class:`~laneserve.costmodel.base.CostModel`."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int = 1,
                 attention: str = "ragged", host_overhead: bool = False,
                 decode_kernel: str = "gqa_packed") -> None:
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
        if tp < 1 or model.num_heads % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide num_heads={model.num_heads}")
        self.model, self.hw, self.tp, self.attention = model, hw, tp, attention
        self.decode_kernel = decode_kernel
        self.name = (f"analytic:{model.name}@{hw.name}" + (f"-tp{tp}" if tp > 1 else "")
                     + ("" if decode_kernel == "gqa_packed" else f"-{decode_kernel}"))
        self.num_layers = model.num_layers
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._q_local = model.q_dim // tp
        self._kv_local = max(model.num_kv_heads // tp, 1) * model.head_dim
        self._heads_local = model.num_heads // tp
        self._decode_blocks = (self._heads_local if decode_kernel == "per_query_head"
                               else max(model.num_kv_heads // tp, 1))
        self._op_overhead = hw.layer_overhead_s / len(LAYER_OPERATORS)
        self._host = hw.host if host_overhead else None
        self._allreduce = hw.allreduce_link(tp) if tp > 1 else None
        self._fixed_cache: dict[tuple[float, int], float] = {}
        self._prefill_cache: dict[tuple[tuple[int, int], ...], float] = {}
        self._decode_attention_fns: dict[int, tuple[Callable[..., Any], ...]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for sweep workers: the memoised decode-attention closures are left behind."""
        return {**self.__dict__, "_decode_attention_fns": {}}

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

    def expert_gemm_time(self, tokens: float, d_in: int, d_out: int, *, split_out: bool = True) -> float:
        """An MoE expert GEMM over ``tokens`` tokens: ``experts_per_token`` rows per token spread
        over the experts they touch (expected distinct experts of uniform routing), each expert's
        weights read once, all in one grouped launch (one ``gemm_overhead_s``, as a fused-MoE
        kernel runs them); a dense model has one expert that every token uses."""
        m = self.model
        if not m.is_moe or tokens <= 0:
            return self.gemm_time(tokens, d_in, d_out, split_out=split_out)
        e, k = m.num_experts, m.experts_per_token
        active = e * (1.0 - (1.0 - k / e) ** tokens)
        launch = self.hw.gemm_overhead_s
        return active * (self.gemm_time(tokens * k / active, d_in, d_out, split_out=split_out) - launch) + launch

    def linear_op_times(self, tokens: float) -> dict[str, float]:
        """The GEMM part of each linear operator of one layer."""
        m = self.model
        return {"qkv_proj": self.gemm_time(tokens, m.hidden_size, m.q_dim + 2 * m.kv_dim),
                "o_proj": self.gemm_time(tokens, m.q_dim, m.hidden_size, split_out=False),
                "gate_up": self.expert_gemm_time(tokens, m.hidden_size, m.gate_up_params // m.hidden_size),
                "down": self.expert_gemm_time(tokens, m.intermediate_size, m.hidden_size,
                                              split_out=False)}

    def elementwise_times(self, tokens: float, *, eager: bool = True) -> dict[str, float]:
        """The small kernels of one layer, keyed by the operator they are folded in: input norm and
        rotary in ``qkv_proj``, the second norm in ``gate_up``, activation and residual add in
        ``down``; each ``kernel_floor_s`` plus its HBM traffic, with ``eager`` also the extra
        traffic of an eager engine's unfused kernels (``eager_bytes_per_element``)."""
        m, hw = self.model, self.hw
        nbytes = hw.elementwise_bytes_per_element + (hw.eager_bytes_per_element if eager else 0.0)
        per_elem, floor = nbytes / hw.hbm_bandwidth, hw.kernel_floor_s
        rope = (self._q_local + self._kv_local) if m.rope else 0
        return {"qkv_proj": (2 if m.rope else 1) * floor + tokens * (m.hidden_size + rope) * per_elem,
                "gate_up": floor + tokens * m.hidden_size * per_elem,
                "down": 2 * floor + tokens * (m.mlp_rows_per_token * m.intermediate_size // self.tp
                                              + m.hidden_size) * per_elem}

    def attention_kernel_time(self, blocks: int, max_keys: float, mean_keys: float) -> float:
        """Thread-block schedule of one FlashAttention kernel: ``blocks`` blocks (prefill: 128
        query rows of one head; decode: one request's KV head or query head, see
        :data:`DECODE_KERNELS`) walk their keys one tile at a time. Up to ``num_sms`` blocks run side by
        side, so the kernel lasts as long as its longest walk (``max_keys``); more blocks queue up
        in ``ceil(blocks / num_sms)`` waves of the average walk (``mean_keys``), blocks sharing an
        SM at ``attn_shared_factor`` of their serial cost. Without split-KV a batch-1 decode over a
        long context is one block per head walking the whole KV: far slower than its bytes."""
        hw = self.hw
        tile = hw.attn_tile_keys

        def walk(keys: float) -> float:
            return hw.attn_block_s + hw.attn_key_s * tile * math.ceil(keys / tile)

        longest = walk(max_keys)
        if blocks <= hw.num_sms:
            return longest
        waves = math.ceil(blocks / hw.num_sms)
        return max(longest, hw.attn_shared_factor * waves * walk(mean_keys))

    def _prefill_pairs(self, batch: PrefillBatch) -> list[tuple[int, int]]:
        """The (new, cached) token pairs attention works on: each chunk's, or on a padded kernel
        every chunk padded to the longest new part and the longest total."""
        pairs = [(n, c) for n, c in batch if n > 0]
        if pairs and self.attention == "padded":
            new, total = max(n for n, _ in pairs), max(n + c for n, c in pairs)
            pairs = [(new, total - new)] * len(pairs)
        return pairs

    def prefill_attention_time(self, batch: PrefillBatch) -> float:
        """Causal attention of prefill chunks in one layer (new tokens attend to cached + new)."""
        pairs = self._prefill_pairs(batch)
        if not pairs:
            return 0.0
        dtype, hw = self.model.dtype_bytes, self.hw
        query_pairs = sum(n * (c + n / 2) for n, c in pairs)
        flops = 4.0 * self._q_local * query_pairs
        kv_read = sum(n + c for n, c in pairs) * 2 * self._kv_local
        q_o = sum(n for n, _ in pairs) * (2 * self._q_local + 2 * self._kv_local)
        nbytes = dtype * (kv_read + q_o)
        roofline = max(flops / (hw.peak_flops * hw.attention_efficiency),
                       nbytes / (hw.hbm_bandwidth * hw.memory_efficiency))
        # a request's query blocks walk cached + (half of, on average) its new keys
        row_blocks = [math.ceil(n / ATTN_BLOCK_ROWS) for n, _ in pairs]
        blocks = sum(row_blocks) * self._heads_local
        walked = sum(b * (c + n / 2) for b, (n, c) in zip(row_blocks, pairs)) * self._heads_local
        kernel = self.attention_kernel_time(blocks, max(n + c for n, c in pairs), walked / blocks)
        return max(roofline, kernel) + hw.attn_floor_s

    def decode_attention_time(self, context_lens: Sequence[int]) -> float:
        """One query per request over its whole KV: the larger of the KV bytes at HBM bandwidth
        (read once per KV head) and the thread-block schedule (per request a block per KV head or
        per query head, by ``decode_kernel``; no split-KV), plus the kernel floor."""
        if not context_lens:
            return 0.0
        return self._decode_attention(len(context_lens))(sum(context_lens), max(context_lens))

    def _decode_attention(self, batch: int) -> Callable[..., Any]:
        """:meth:`decode_attention_time` of ``batch`` requests as a function of their summed and
        longest context (all it depends on), the terms fixed by the batch size computed once. It
        takes numpy arrays of both too (with ``ceil=np.ceil, maximum=np.maximum``): the same
        operations in the same order, so the same floats."""
        return self._decode_terms(batch)[0]

    def _decode_terms(self, batch: int) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], bool]:
        """``(attention(total, longest), roofline(kv_tokens), kernel(kv_tokens, longest), queued)``
        of a decode batch of ``batch`` requests, memoised; ``kv_tokens`` is the KV the kernel reads
        (``total``, or ``batch * longest`` padded), ``attention`` is ``max(roofline, kernel) +
        floor`` and ``queued`` says whether the kernel's blocks queue in waves (then the mean
        context counts too, not only the longest)."""
        terms = self._decode_attention_fns.get(batch)
        if terms is not None:
            return terms
        hw, kv_local = self.hw, self._kv_local
        padded, dtype = self.attention == "padded", self.model.dtype_bytes
        per_request_bytes = batch * 2 * (self._q_local + kv_local)
        flops_per_key = 4.0 * self._q_local
        flop_rate = hw.peak_flops * hw.attention_efficiency
        byte_rate = hw.hbm_bandwidth * hw.memory_efficiency
        # attention_kernel_time's schedule, unrolled: one walk, or waves of the mean walk
        blocks, tile, block_s = batch * self._decode_blocks, hw.attn_tile_keys, hw.attn_block_s
        tile_s = hw.attn_key_s * tile
        queued = blocks > hw.num_sms
        waves = hw.attn_shared_factor * math.ceil(blocks / hw.num_sms)
        floor = hw.attn_floor_s

        def roofline(kv_tokens, maximum=max):
            return maximum(flops_per_key * kv_tokens / flop_rate,
                           dtype * (kv_tokens * 2 * kv_local + per_request_bytes) / byte_rate)

        def kernel(kv_tokens, longest, ceil=math.ceil, maximum=max):
            walk = block_s + tile_s * ceil(longest / tile)
            if queued:
                walk = maximum(walk, waves * (block_s + tile_s * ceil(kv_tokens / batch / tile)))
            return walk

        def attention(total, longest, ceil=math.ceil, maximum=max):
            kv_tokens = batch * longest if padded else total
            return maximum(roofline(kv_tokens, maximum), kernel(kv_tokens, longest, ceil, maximum)) + floor

        terms = self._decode_attention_fns[batch] = (attention, roofline, kernel, queued)
        return terms

    def allreduce_time(self, tokens: float) -> float:
        """One all-reduce of the hidden states of ``tokens`` tokens among the ``tp`` GPUs."""
        if self._allreduce is None or tokens <= 0:
            return 0.0
        return self._allreduce.transfer_time(tokens * self.model.hidden_size * self.model.dtype_bytes)

    def host_time(self, seqs: int) -> float:
        """CPU cost of one iteration over ``seqs`` sequences (0 with ``host_overhead=False``)."""
        return self._host.time(seqs, self.tp) if self._host is not None else 0.0

    def _layer_ops(self, tokens: float, attention_s: float, launch: bool = True) -> list[float]:
        lin, ar = self.linear_op_times(tokens), self.allreduce_time(tokens)
        elem = self.elementwise_times(tokens, eager=launch)
        ov = self._op_overhead if launch else 0.0
        return [lin["qkv_proj"] + elem["qkv_proj"] + ov,
                attention_s + ov,
                lin["o_proj"] + ar + ov,
                lin["gate_up"] + elem["gate_up"] + ov,
                lin["down"] + elem["down"] + ar + ov]

    def layer_time(self, tokens: float, attention_s: float, *, launch: bool = True) -> float:
        """One transformer layer over ``tokens`` tokens whose attention takes ``attention_s``
        (the five operators with their all-reduces). ``launch=False`` leaves out what the eager
        engine adds (its per-layer launch cost ``layer_overhead_s`` and its unfused kernels'
        extra traffic): the fused-kernel GPU time alone."""
        return sum(self._layer_ops(tokens, attention_s, launch)) if tokens > 0 else 0.0

    def _head_times(self, tokens: float, rows: int) -> tuple[float, float]:
        """(host cost + embedding and its all-reduce, final norm + LM head) for a step of
        ``tokens`` tokens and ``rows`` logits (one per sequence)."""
        m = self.model
        per_elem = self.hw.elementwise_bytes_per_element / self.hw.hbm_bandwidth
        small = self.hw.kernel_floor_s + tokens * m.hidden_size * per_elem
        embed = self.host_time(rows) + small + self.allreduce_time(tokens)
        head = small + self.gemm_time(rows, m.hidden_size, m.vocab_size)
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
        key = tuple(batch)        # memoised: a trace asks for the same prompt lengths again and again
        t = self._prefill_cache.get(key)
        if t is None:
            t = self._step_time(sum(n for n, _ in key), self.prefill_attention_time(key), len(key))
            if len(self._prefill_cache) < 1 << 16:
                self._prefill_cache[key] = t
        return t

    def graphed_prefill_time(self, batch: PrefillBatch) -> float:
        """A prefill step replayed from a captured CUDA graph: the per-layer launch cost of the
        small kernels (``layer_overhead_s``) disappears; GEMM, attention, element-wise work,
        collectives and the host's per-iteration CPU cost (scheduling, sampling: not launches)
        stay. This assumes the calibrated layer overhead is CPU launch time, as its definition
        says (HF-eager-like profile); a fused engine would gain less."""
        t = self.prefill_time(batch)
        return t - self.num_layers * self.hw.layer_overhead_s if t > 0 else t

    def prefill_op_times(self, batch: PrefillBatch) -> list[float]:
        batch = list(batch)
        tokens = sum(n for n, _ in batch)
        return self._step_ops(tokens, self.prefill_attention_time(batch), len(batch))

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        if not context_lens:
            return 0.0
        batch = len(context_lens)     # (decode_summary_time's formula, inline: a hot path)
        return self._step_time(batch, self._decode_attention(batch)(sum(context_lens), max(context_lens)),
                               batch)

    def decode_summary_time(self, batch: int, total: int, longest: int) -> float:
        """:meth:`decode_step_time` of ``batch`` requests whose contexts sum to ``total``, the
        longest ``longest`` (all it reads of a decode batch)."""
        if batch <= 0:
            return 0.0
        return self._step_time(batch, self._decode_attention(batch)(total, longest), batch)

    def decode_step_times(self, batch: int, total: int, longest: int, steps: int) -> list[float]:
        """:meth:`decode_step_time` of ``steps`` consecutive steps of the same ``batch`` requests,
        the first with contexts summing to ``total``, the longest ``longest``, each later one a
        token longer per request: the same floats (the simulator's runs of a stable decode batch).

        The attention kernel's schedule changes only when the longest or the mean context crosses
        a key tile, and both terms of ``max(roofline, kernel)`` never decrease from step to step
        (each is rounded monotone arithmetic on growing integers). So between tile crossings the
        steps whose roofline does not exceed the kernel form a prefix that all take one time, found
        with a few scalar evaluations; only the steps after it are computed one by one (as arrays
        when there are many). The crossings are exact: for integers ``x`` and ``d`` far below 2^50
        the kernel's ``ceil(x / d)`` (and ``ceil(x / batch / tile)``) is the integer ceiling, a
        non-integer quotient being at least ``1 / d`` away from the next integer, far more than
        its rounding error."""
        fixed, layers = self._step_time(batch, 0.0, batch), self.num_layers
        attention, roofline, kernel, queued = self._decode_terms(batch)
        padded, tile = self.attention == "padded", self.hw.attn_tile_keys
        span, floor = batch * tile, self.hw.attn_floor_s
        out: list[float] = []
        start = None                       # first step of the stretch computed one by one

        def computed(j0: int, j1: int) -> None:
            if j1 - j0 < _ARRAY_STEPS:
                out.extend([fixed + layers * attention(total + batch * j, longest + j) for j in range(j0, j1)])
            else:
                grown = np.arange(j0, j1)
                out.extend((fixed + layers * attention(total + batch * grown, longest + grown,
                                                       np.ceil, np.maximum)).tolist())

        j = 0
        while j < steps:
            top = longest + j
            kv = batch * top if padded else total + batch * j
            # the last step before the longest (or, queued, the mean) context enters a new key tile
            last = j + -(-top // tile) * tile - top
            if queued:
                last = min(last, j + (-(-kv // span) * span - kv) // batch)
            if last >= steps:
                last = steps - 1
            kv_last = kv + batch * (last - j)
            k = kernel(kv, top)
            if roofline(kv_last) <= k:
                first = last + 1
            else:                          # the first step whose roofline exceeds the kernel
                lo, hi = j, last
                while lo < hi:
                    mid = (lo + hi) // 2
                    if roofline(kv + batch * (mid - j)) > k:
                        hi = mid
                    else:
                        lo = mid + 1
                first = lo
            if first > j:
                if start is not None:
                    computed(start, j)
                    start = None
                out.extend([fixed + layers * (k + floor)] * (first - j))
            if first <= last and start is None:
                start = first
            j = last + 1
        if start is not None:
            computed(start, steps)
        return out

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
        return (f"AnalyticCostModel({self.model.name!r}, {self.hw.name!r}, tp={self.tp}, "
                f"attention={self.attention!r}, host_overhead={self._host is not None}, "
                f"decode_kernel={self.decode_kernel!r})")
