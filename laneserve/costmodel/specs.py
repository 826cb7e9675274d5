"""Model and hardware specifications for the analytic (roofline) cost model (docs/design.md, "Cost
models"; the roofline view of LAPS §2.1: the compute/memory boundary sits where the arithmetic
intensity reaches P_peak / B_mem).

Model shapes are the published Hugging Face ``config.json`` values. Hardware numbers are vendor peak
figures; the efficiency, FlashAttention, all-reduce and host-overhead terms are *calibrated* on the
measured profiles packaged in ``laneserve/costmodel/data`` by ``laneserve calibrate``
(:mod:`laneserve.costmodel.calibrate`), which generates :mod:`laneserve.costmodel.fitted_constants`
(a Python module, so nothing reads a file at import). Link bandwidths/latencies come from a fit of
Vidur's H100 DGX send/recv profile (:func:`fit_send_recv`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from .fitted_constants import ALLREDUCE, H100_ATTENTION, H100_CALIBRATION, HOST_OVERHEAD


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer (one replica, before tensor parallelism)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype_bytes: int = 2
    gated_mlp: bool = True          # SwiGLU gate+up (Llama/Qwen); OPT has fc1 -> act -> fc2
    activation: str = "silu"
    rope: bool = True                # rotary embeddings (OPT uses learned positions)
    tied_embeddings: bool = False
    #: mixture of experts (Mixtral-style): ``num_experts`` MLPs of ``intermediate_size`` per layer,
    #: each token routed to ``experts_per_token`` of them; 0 = dense
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_rows_per_token(self) -> int:
        """Rows of the MLP activation per token: one per routed expert in an MoE layer."""
        return self.experts_per_token if self.is_moe else 1

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_params(self) -> int:
        return self.hidden_size * (self.q_dim + 2 * self.kv_dim)

    @property
    def o_params(self) -> int:
        return self.q_dim * self.hidden_size

    @property
    def gate_up_params(self) -> int:
        return self.hidden_size * self.intermediate_size * (2 if self.gated_mlp else 1)

    @property
    def down_params(self) -> int:
        return self.intermediate_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """Weights of one layer (every expert of an MoE layer, plus its router)."""
        experts = max(self.num_experts, 1)
        router = self.hidden_size * self.num_experts
        return (self.qkv_params + self.o_params + experts * (self.gate_up_params + self.down_params)
                + router)

    @property
    def active_layer_params(self) -> int:
        """Weights one token multiplies with in one layer (its routed experts only)."""
        experts = self.experts_per_token if self.is_moe else 1
        return self.qkv_params + self.o_params + experts * (self.gate_up_params + self.down_params)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Weight count (norms and biases ignored: < 0.1%)."""
        heads = 1 if self.tied_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs per token through all layers (2 per multiply-add), LM head excluded."""
        return 2 * self.num_layers * self.active_layer_params


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link or collective: time(bytes) = max(floor, latency + bytes / bandwidth). ``floor`` is the
    least time any message takes (an all-reduce's protocol floor; 0 for the point-to-point links)."""

    bandwidth: float    # bytes/s
    latency: float      # s
    floor: float = 0.0  # s

    def transfer_time(self, nbytes: float) -> float:
        return max(self.floor, self.latency + nbytes / self.bandwidth) if nbytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """CPU-side cost of one engine iteration (schedule, prepare inputs, sample, process outputs,
    and with tensor parallelism the driver-to-worker messaging): ``base_s + per_seq_s * seqs``,
    plus ``tp_s`` when the instance spans more than one GPU. Fitted on Vidur's A100 vLLM-style
    engine profile (:func:`laneserve.costmodel.calibrate.fit_host_overhead`)."""

    base_s: float
    per_seq_s: float
    tp_s: float

    def time(self, seqs: int, tp: int) -> float:
        if seqs <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * seqs + (self.tp_s if tp > 1 else 0.0)


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator plus its links.

    Efficiency terms (calibrated, see :mod:`laneserve.costmodel.fitted_constants`):
    ``gemm_efficiency_max * n / (n + gemm_half_tokens)`` is the achieved fraction of peak FLOP/s
    of a GEMM with ``n`` rows; ``memory_efficiency`` the achieved fraction of HBM bandwidth when
    streaming weights or KV; ``attention_efficiency`` the fraction of peak reached by prefill
    attention; ``elementwise_bytes_per_element`` the effective HBM traffic of the norm / rotary /
    activation kernels per element; ``gemm_overhead_s`` a fixed cost per GEMM kernel;
    ``kernel_floor_s`` the least time of one small (norm / rotary / activation / residual-add)
    kernel, fitted on Vidur's fused vLLM kernels; what an eager engine adds (the HF-eager
    LLMServingSim profile): ``eager_bytes_per_element`` of extra small-kernel traffic (unfused
    norms and rotary) and ``layer_overhead_s`` of fixed cost a layer (launches), the latter dropped
    under CUDA-graph replay.

    FlashAttention kernel terms (``attn_*``, see :meth:`AnalyticCostModel.attention_kernel_time`):
    a thread block handles 128 query rows of one head and walks the keys one tile
    (``attn_tile_keys``) at a time, ``attn_key_s`` per key plus ``attn_block_s`` per block; blocks
    beyond ``num_sms`` queue up, sharing an SM at ``attn_shared_factor`` of the serial cost; every
    kernel pays ``attn_floor_s``. ``allreduce`` maps a GPU count to the fitted
    ``latency + bytes / bandwidth`` of one all-reduce among that many GPUs of a node; ``host`` is the
    per-iteration CPU cost.
    """

    name: str
    peak_flops: float               # dense bf16 FLOP/s
    hbm_bandwidth: float            # bytes/s
    memory_bytes: int
    gemm_efficiency_max: float
    gemm_half_tokens: float
    memory_efficiency: float
    attention_efficiency: float
    elementwise_bytes_per_element: float
    gemm_overhead_s: float
    layer_overhead_s: float
    kernel_floor_s: float = 0.0
    eager_bytes_per_element: float = 0.0
    num_sms: int = 132
    attn_key_s: float = 0.0
    attn_block_s: float = 0.0
    attn_tile_keys: int = 64
    attn_shared_factor: float = 1.0
    attn_floor_s: float = 0.0
    links: dict[str, LinkSpec] = field(default_factory=dict)
    allreduce: dict[int, LinkSpec] = field(default_factory=dict)
    host: HostOverhead | None = None

    def gemm_efficiency(self, tokens: float) -> float:
        return self.gemm_efficiency_max * tokens / (tokens + self.gemm_half_tokens)

    def link(self, name: str) -> LinkSpec:
        key = {"rdma": "infiniband", "ib": "infiniband"}.get(name.lower(), name.lower())
        if key not in self.links:
            raise ValueError(f"unknown link {name!r}; valid: {sorted(self.links) + ['rdma']}")
        return self.links[key]

    def allreduce_link(self, gpus: int) -> LinkSpec:
        """The fitted all-reduce among ``gpus`` GPUs: the smallest measured count >= ``gpus``
        (the largest one beyond the table); without a table, a ring over the NVLink link
        (``2 (n-1)/n`` of the bytes each way)."""
        fitted = sorted(self.allreduce)
        for n in fitted:
            if n >= gpus:
                return self.allreduce[n]
        if fitted:
            return self.allreduce[fitted[-1]]
        link = self.link("nvlink")
        return LinkSpec(bandwidth=link.bandwidth * gpus / (2 * (gpus - 1)), latency=link.latency)


def fit_link(samples: Iterable[tuple[float, float]]) -> LinkSpec:
    """Least-squares fit of ``seconds = latency + bytes / bandwidth`` to (bytes, seconds) pairs."""
    import numpy as np

    data = np.asarray(list(samples), dtype=float)
    design = np.column_stack([np.ones(len(data)), data[:, 0]])
    (latency, inv_bw), *_ = np.linalg.lstsq(design, data[:, 1], rcond=None)
    return LinkSpec(bandwidth=float(1.0 / inv_bw), latency=float(max(latency, 0.0)))


def fit_send_recv(path: str) -> dict[str, LinkSpec]:
    """Fit Vidur's send/recv profile: ``devices_per_node == 2`` is two GPUs of one DGX (NVLink),
    ``devices_per_node == 1`` two GPUs on different nodes (InfiniBand)."""
    from .profile import load_vidur_send_recv

    rows = load_vidur_send_recv(path)
    return {"nvlink": fit_link((r.nbytes, r.seconds) for r in rows if r.devices_per_node > 1),
            "infiniband": fit_link((r.nbytes, r.seconds) for r in rows if r.devices_per_node == 1)}


# Fit of vidur_h100_dgx_send_recv.csv (fit_send_recv), rounded.
H100_NVLINK = LinkSpec(bandwidth=362e9, latency=8.0e-6)
H100_INFINIBAND = LinkSpec(bandwidth=34.5e9, latency=7.1e-6)
# Nominal, not measured here: PCIe Gen5 x16 (~64 GB/s raw) and pinned host copies over it.
PCIE5 = LinkSpec(bandwidth=50e9, latency=10e-6)
HOST5 = LinkSpec(bandwidth=40e9, latency=20e-6)

_H100_LINKS = {"nvlink": H100_NVLINK, "infiniband": H100_INFINIBAND, "pcie": PCIE5, "host": HOST5}


def _links(table: dict[str, list[float]]) -> dict[int, LinkSpec]:
    return {int(n): LinkSpec(bandwidth=bw, latency=lat, floor=floor)
            for n, (lat, bw, floor) in table.items()}


#: CPU cost of an iteration: Vidur's profile is of an A100 host; the same host cost is assumed on
#: H100/H200 nodes (it is CPU work, not GPU work).
HOST = HostOverhead(**HOST_OVERHEAD)

H100_SXM = HardwareSpec(name="h100", peak_flops=989.4e12, hbm_bandwidth=3.35e12,
                        memory_bytes=80 * 10**9, num_sms=132, links=_H100_LINKS,
                        allreduce=_links(ALLREDUCE["h100"]), host=HOST,
                        **H100_CALIBRATION, **H100_ATTENTION)


def _key_cost(hbm_bandwidth: float) -> float:
    """A FlashAttention block's per-key cost on another GPU: at full occupancy the H100 fit streams
    KV at about its HBM bandwidth, so the per-key cost is scaled by the bandwidth ratio
    (*assumption*: no attention profile of that GPU)."""
    return H100_ATTENTION["attn_key_s"] * H100_SXM.hbm_bandwidth / hbm_bandwidth


H200_SXM = replace(H100_SXM, name="h200", hbm_bandwidth=4.8e12, memory_bytes=141 * 10**9,
                   attn_key_s=_key_cost(4.8e12))

A100_SXM_80GB = replace(
    H100_SXM, name="a100", peak_flops=312e12, hbm_bandwidth=2.039e12, memory_bytes=80 * 10**9,
    num_sms=108, allreduce=_links(ALLREDUCE["a100"]), attn_key_s=_key_cost(2.039e12),
    links={"nvlink": LinkSpec(250e9, 8e-6), "infiniband": LinkSpec(24e9, 17e-6),
           "pcie": LinkSpec(25e9, 10e-6), "host": LinkSpec(20e9, 20e-6)})

#: Registry of hardware. H200 = H100 compute (same peak FLOP/s, same calibrated efficiencies, same
#: all-reduce fit) with 4.8 TB/s instead of 3.35 TB/s HBM and 141 GB. *Assumption*: there is no
#: H200 profile anywhere we looked, so memory-bound terms (and FlashAttention's per-key cost) scale
#: by bandwidth alone. The A100 reuses the H100 efficiency and FlashAttention terms with A100 peaks
#: (312 TFLOP/s, 2.039 TB/s, 108 SMs); its all-reduce is fitted on the A100 DGX profile.
HARDWARE: dict[str, HardwareSpec] = {"h100": H100_SXM, "h200": H200_SXM, "a100": A100_SXM_80GB}


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
           ctx: int, head_dim: int = 128, tied: bool = False) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
                     vocab_size=vocab, max_context=ctx, tied_embeddings=tied)


#: Registry of models, from the published HF configs.
MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 131072),
    _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768),
    _llama("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 32768),
    _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 32768),
    _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 32768),
    _llama("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, 40960),
    _llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 40960),
    ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
              head_dim=128, intermediate_size=14336, vocab_size=32000, max_context=32768,
              num_experts=8, experts_per_token=2),
    # Qwen3-30B-A3B: every layer sparse, 128 experts of moe_intermediate_size 768, 8 routed per
    # token (30.5B weights, 3.3B active with the embeddings)
    ModelSpec(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
              head_dim=128, intermediate_size=768, vocab_size=151936, max_context=40960,
              num_experts=128, experts_per_token=8),
    ModelSpec(name="opt-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
              head_dim=128, intermediate_size=20480, vocab_size=50272, max_context=2048,
              gated_mlp=False, activation="relu", rope=False, tied_embeddings=True),
    ModelSpec(name="opt-30b", num_layers=48, hidden_size=7168, num_heads=56, num_kv_heads=56,
              head_dim=128, intermediate_size=28672, vocab_size=50272, max_context=2048,
              gated_mlp=False, activation="relu", rope=False, tied_embeddings=True),
]}
