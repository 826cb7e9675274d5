"""Engine configuration (docs/design.md, "Decisions": config as frozen dataclasses; derived values are
computed, not mutated into the config).

Defaults follow the device (fields left at ``"auto"`` / ``None`` are resolved at construction):

* CPU: float32 ("Facts measured on this machine": bf16 changes logits and is 2x slower for
  batched decode on CPU), eager steps (``cuda_graphs=False``), ``"ragged"`` attention;
* CUDA: the checkpoint's dtype (``dtype="auto"``, resolved by the loader: bf16 for the usual
  checkpoints), ``cuda_graphs=True``, and ``"paged"`` attention (Triton kernels reading the paged
  KV cache, ``engine/triton_attention.py``) where Triton imports, else ``"ragged"`` with SDPA held
  to its FlashAttention / memory-efficient kernels.

``cuda_graphs`` turns on the static shape-bucket path of ``engine/graphs.py`` (LAPS §3): decode
steps padded to ``(batch, context)`` buckets and short fresh prefills with a ``plan.padded_shape``
padded to ``(L, B)`` buckets, each bucket a power-of-two grid up to the ``graph_max_*`` fields.
On CUDA each bucket is captured as a CUDA graph on first use and replayed afterwards; on CPU the
same static path runs eagerly (docs/design.md, "LAPS"), which is how the tests verify it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_GRANULARITIES = ("operator", "layer", "chunk")
#: smallest decode-context and prefill-length buckets of the ``cuda_graphs`` grids
MIN_GRAPH_CONTEXT = 16
MIN_GRAPH_PREFILL_LEN = 8


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = "cpu"
    #: "auto" (default) takes the checkpoint's dtype on CUDA and float32 on CPU (resolved to
    #: "float32" at construction there); fp16 is CUDA-only
    dtype: str = "auto"
    block_size: int = 16
    #: device KV blocks; ``None`` derives them from ``kv_memory_fraction`` (see :meth:`resolve_num_kv_blocks`)
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.3
    #: attention path by registry name: "padded" (pays the longest context), "ragged" (pays the sum),
    #: "paged" (CUDA: Triton kernels over the paged cache); "auto" (default) resolves per device
    attention: str = "auto"
    #: sizes the preallocated workspaces; larger steps still run (the workspaces grow once)
    max_num_batched_tokens: int = 2048
    #: host-pool KV blocks (AlignedServe §3 host tier); 0 = no host pool
    num_host_blocks: int = 0
    seed: int = 0
    #: torch intra-op threads on CPU (``None`` = leave torch's default)
    num_threads: int | None = None
    #: record per-operator durations on every plan (they are always recorded on preemptible plans)
    record_op_times: bool = False
    #: static shape buckets for non-preemptible decode and short fresh prefill steps (engine/graphs.py):
    #: captured as CUDA graphs on CUDA, run eagerly on the same static buffers on CPU; other steps
    #: (mixed, cached-prefix chunks, preemptible plans, record_op_times, beyond the grid) take the eager path
    #: ``None`` (default): on for CUDA devices, off elsewhere (resolved at construction)
    cuda_graphs: bool | None = None
    #: decode buckets: batch in {1, 2, 4, .., graph_max_batch} x padded context in
    #: {16, 32, .., graph_max_context} (the context gather workspace holds max_batch x max_context rows)
    graph_max_batch: int = 64
    graph_max_context: int = 2048
    #: short-prefill buckets (LAPS grid): L in {8, 16, .., graph_max_prefill_len} x B in
    #: {1, 2, .., graph_max_prefill_batch}
    graph_max_prefill_len: int = 256
    graph_max_prefill_batch: int = 64
    #: keep prompt KV across requests on prefill and colocated instances (content-hashed blocks,
    #: core/block_pool.py); a request starts on the leading blocks found cached
    prefix_caching: bool = True
    #: preemptible steps: at a boundary where a stop may be taken, at most this many launched
    #: operators may still be running on the device when ``should_stop()`` is asked, so a stop is
    #: acknowledged within that many operators' execution (1: launch, wait, check; 2: one operator
    #: queued behind the running one, no launch gap on the device). 0 asks at launch time without
    #: waiting (on an asynchronous device a stop then lands only once the launched work drains).
    preempt_max_inflight: int = 1

    def __post_init__(self) -> None:
        cuda = self.device.startswith("cuda")
        if self.dtype == "auto" and not cuda:
            object.__setattr__(self, "dtype", "float32")
        if self.cuda_graphs is None:
            object.__setattr__(self, "cuda_graphs", cuda)
        if self.attention == "auto":
            object.__setattr__(self, "attention", default_attention(self.device))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.preempt_max_inflight < 0:
            raise ValueError("preempt_max_inflight must be >= 0")
        if self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("float16 is only supported on CUDA; use float32 or bfloat16 on CPU")
        for name, low in (("graph_max_batch", 1), ("graph_max_context", MIN_GRAPH_CONTEXT),
                          ("graph_max_prefill_len", MIN_GRAPH_PREFILL_LEN), ("graph_max_prefill_batch", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {low}, got {value!r}")

    def resolve_num_kv_blocks(self, kv_bytes_per_token: int, free_bytes: int | None = None) -> int:
        """Device KV blocks: ``num_kv_blocks`` when set, else ``kv_memory_fraction`` of the free
        device memory (CUDA: ``torch.cuda.mem_get_info``; CPU: available RAM)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if free_bytes is None:
            free_bytes = _free_memory_bytes(self.device)
        blocks = int(free_bytes * self.kv_memory_fraction) // (kv_bytes_per_token * self.block_size)
        if blocks < 1:
            raise ValueError(f"no room for a single KV block ({kv_bytes_per_token} B/token) "
                             f"in {free_bytes} B x {self.kv_memory_fraction}")
        return blocks


def default_attention(device: str) -> str:
    """The attention path a device gets by default: ``"paged"`` on CUDA when Triton imports,
    ``"ragged"`` otherwise."""
    if not device.startswith("cuda"):
        return "ragged"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "ragged"
    return "paged"


def _free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
