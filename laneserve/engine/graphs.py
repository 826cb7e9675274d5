"""Static-shape bucket runner: the engine side of LAPS' captured shapes (LAPS §3; docs/design.md,
"LAPS": "CUDA graphs are captured per shape only on CUDA; on CPU the same bucketed, padded path
runs eagerly").

Buckets (:class:`BucketGrid`, power-of-two grids bounded by ``EngineConfig.graph_max_*``):

* decode ``(B, C)``: a decode-only step of ``b <= B`` requests whose longest context is ``<= C``;
  one token row per request, ``B - b`` padding rows;
* prefill ``(L, B)``: a step of ``b <= B`` *fresh* prefill chunks (no cached tokens) of ``<= L``
  tokens each, the LAPS ``plan.padded_shape``; sequence ``i`` occupies rows ``[i*L, (i+1)*L)``.

Each bucket owns preallocated input tensors that are refilled in place (``copy_``) before a run:
the token ids, the per-row lengths and the block tables (padding entries = the scratch block). The
rest of the metadata — positions, KV write slots, logit rows, the context gather index and the
attention mask — is computed from those *inside* the run (:meth:`BucketRunner._forward`) into
static tensors, so a captured graph recomputes it on replay and the host ships only
``B x (blocks per row)`` table entries instead of ``B x C`` slots. Padding rows (and padding
context columns) write their K/V to, and gather from, a scratch slot in an extra block of the
``PagedKVCache`` that the ``KVCacheManager`` never hands out; the mask hides them (each row still
sees key 0, so no softmax row is empty). Real KV is never touched and real outputs do not change.

The forward is the model's own operator generator (``LlamaModel.steps``) over those static tensors
with :class:`~laneserve.engine.attention.StaticPaddedAttention`, drained without stopping: no
``.item()``/``.tolist()``, no data-dependent shapes or branches (``tests/test_engine_graphs.py``
checks this with a dispatch-mode trace on CPU).

On CUDA a bucket is warmed up on a side stream and captured (``torch.cuda.CUDAGraph``, one memory
pool shared by all buckets) the first time it is used, then replayed. Capture runs in
``thread_local`` error mode, so instances running in other threads of the same process keep
synchronising and allocating while one of them captures. Sharing the pool is safe
because graphs never run concurrently and a bucket's output logits are copied out right after its
replay, before any other graph runs; the static inputs and the gather workspace live outside the
pool. The warm-up and capture re-run the step on identical inputs, which rewrites identical KV.
On any other device the same ``_forward`` runs eagerly.

Steps that fit no bucket fall back to the resumable eager path (:meth:`BucketRunner.select`):
preemptible plans (a replay cannot stop at an operator boundary), ``record_op_times``, mixed
prefill + decode steps, prefill chunks on top of cached tokens, prefills without a
``padded_shape``, and anything beyond the grid.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch

from laneserve.core.plan import StepPlan
from laneserve.core.shapes import ShapeGrid
from laneserve.engine.attention import StaticAttentionMeta, StaticPaddedAttention
from laneserve.engine.config import MIN_GRAPH_CONTEXT, MIN_GRAPH_PREFILL_LEN, EngineConfig
from laneserve.engine.device_stream import copy_in, upload
from laneserve.engine.kv_cache import PagedKVCache
from laneserve.engine.models.llama import LlamaModel, StepTensors
from laneserve.engine.sequence import SeqInput

DECODE, PREFILL = "decode", "prefill"
#: ``torch.cuda.graph`` capture mode: only the capturing thread is checked for unsafe calls
CAPTURE_ERROR_MODE = "thread_local"
_WARMUP_RUNS = 2


def pow2_grid(low: int, high: int) -> tuple[int, ...]:
    """``low, 2*low, ..`` up to ``high`` (both powers of two)."""
    out = []
    value = low
    while value <= high:
        out.append(value)
        value *= 2
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BucketKey:
    """``kind`` "decode": ``batch`` rows over a padded context of ``length``; "prefill":
    ``batch`` fresh sequences of ``length`` padded tokens each."""

    kind: str
    batch: int
    length: int

    @property
    def rows(self) -> int:
        return self.batch if self.kind == DECODE else self.batch * self.length


@dataclass(frozen=True, slots=True)
class BucketGrid:
    """Two LAPS shape grids (:class:`~laneserve.core.shapes.ShapeGrid`): decode
    ``(context, batch)`` and short prefill ``(length, batch)``; a step takes the nearest covering shape."""

    decode_grid: ShapeGrid
    prefill_grid: ShapeGrid

    @classmethod
    def from_config(cls, config: EngineConfig) -> BucketGrid:
        return cls(ShapeGrid(pow2_grid(MIN_GRAPH_CONTEXT, config.graph_max_context), pow2_grid(1, config.graph_max_batch)),
                   ShapeGrid(pow2_grid(MIN_GRAPH_PREFILL_LEN, config.graph_max_prefill_len),
                             pow2_grid(1, config.graph_max_prefill_batch)))

    @property
    def decode_batches(self) -> tuple[int, ...]:
        return self.decode_grid.batches

    @property
    def decode_contexts(self) -> tuple[int, ...]:
        return self.decode_grid.lengths

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        return self.prefill_grid.lengths

    @property
    def prefill_batches(self) -> tuple[int, ...]:
        return self.prefill_grid.batches

    def decode(self, batch: int, max_context: int) -> BucketKey | None:
        """The smallest decode bucket covering ``batch`` requests of contexts ``<= max_context``."""
        shape = self.decode_grid.shape(max_context, batch)
        return None if shape is None else BucketKey(DECODE, shape[1], shape[0])

    def prefill(self, length: int, batch: int) -> BucketKey | None:
        """The smallest prefill bucket covering ``batch`` sequences of ``<= length`` tokens."""
        shape = self.prefill_grid.shape(length, batch)
        return None if shape is None else BucketKey(PREFILL, shape[1], shape[0])

    @property
    def max_decode_rows(self) -> int:
        return self.decode_grid.max_batch * self.decode_grid.max_length


@dataclass(slots=True)
class GraphStats:
    """What the bucket path did: ``captures`` and ``replays`` (CUDA), ``static_eager`` runs (other
    devices), ``fallbacks`` (steps sent to the eager path) and runs per bucket."""

    captures: int = 0
    replays: int = 0
    static_eager: int = 0
    fallbacks: int = 0
    runs: Counter = field(default_factory=Counter)


class _Bucket:
    """The static tensors of one bucket. Filled from the host: ``input_ids``, ``lens`` (context
    length per decode row / new tokens per prefill sequence; 0 = padding) and ``tables`` (block
    table rows, padding = scratch block). Computed in the run: ``step.positions`` (decode),
    ``step.slots``, ``step.logit_rows`` (prefill), ``meta.gather_index`` (decode), ``meta.mask``."""

    __slots__ = ("key", "input_ids", "lens", "tables", "step", "meta", "col", "col_block", "col_offset",
                 "first_col", "causal", "row_base", "graph", "output", "paged")

    def __init__(self, key: BucketKey, block_size: int, device: torch.device,
                 k_workspace: torch.Tensor | None, v_workspace: torch.Tensor | None, paged: bool = False) -> None:
        self.key = key
        b, length = key.batch, key.length
        longs = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(key.rows, **longs)
        self.lens = torch.zeros(b, **longs)
        self.tables = torch.zeros(b, -(-length // block_size), **longs)
        self.col = torch.arange(length, **longs)
        self.col_block = self.col // block_size
        self.col_offset = self.col % block_size
        self.first_col = self.col == 0
        self.graph = None
        self.output: torch.Tensor | None = None
        self.causal = self.row_base = None
        self.paged = None
        if key.kind == DECODE and paged:
            # the paged kernel reads the cache through the block tables: no gather workspace, no mask;
            # kernel metadata = [query row, new tokens (1), context length] per row, the last refilled per run
            from laneserve.engine.triton_attention import PagedMeta
            positions = torch.zeros(b, **longs)
            logit_rows = torch.arange(b, **longs)
            kernel_meta = torch.cat([torch.arange(b, **longs), torch.ones(b, **longs), torch.ones(b, **longs)])
            meta = (PagedMeta(b, 1, kernel_meta, self.tables), block_size, False)
            self.paged = kernel_meta[2 * b:]
        elif key.kind == DECODE:
            positions = torch.zeros(b, **longs)
            logit_rows = torch.arange(b, **longs)
            meta = StaticAttentionMeta(b, 1, length, torch.zeros(b, 1, 1, length, dtype=torch.bool, device=device),
                                       torch.zeros(b * length, **longs),
                                       k_workspace[:b * length], v_workspace[:b * length])
        else:
            positions = self.col.repeat(b)     # fresh prompts: row j of every sequence is position j
            logit_rows = torch.zeros(b, **longs)
            self.causal = self.col[None, :] <= self.col[:, None]
            self.row_base = torch.arange(b, **longs) * length
            meta = StaticAttentionMeta(b, length, length,
                                       torch.zeros(b, 1, length, length, dtype=torch.bool, device=device))
        self.meta = meta
        self.step = StepTensors(input_ids=self.input_ids, positions=positions, slots=torch.zeros(key.rows, **longs),
                                num_tokens=key.rows, logit_rows=logit_rows, attn_meta=meta)


class BucketRunner:
    """Selects, fills and runs shape buckets over ``cache`` (which must have a scratch block)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache, config: EngineConfig,
                 paged: bool | None = None) -> None:
        if cache.scratch_blocks < 1:
            raise ValueError("the bucket runner needs a KV cache with a scratch block")
        self.model = model
        self.cache = cache
        self.config = config
        self.device = model.device
        self.block_size = cache.block_size
        self.scratch_block = cache.scratch_block
        self.scratch_slot = cache.scratch_block * cache.block_size
        self.grid = BucketGrid.from_config(config)
        self.attention = StaticPaddedAttention()
        # decode buckets read the paged cache directly with the Triton kernel when the engine's
        # attention path is "paged" (captured like any other kernel); prefill buckets keep SDPA
        self.paged_attention = None
        if paged if paged is not None else config.attention == "paged":
            from laneserve.engine.triton_attention import PagedAttention
            self.paged_attention = PagedAttention(None)
        self.stats = GraphStats()
        self._buckets: dict[BucketKey, _Bucket] = {}
        self._k_workspace: torch.Tensor | None = None
        self._v_workspace: torch.Tensor | None = None
        self._capture_graphs = self.device.type == "cuda"
        self._pool = None
        self._stream = None

    @property
    def buckets(self) -> list[BucketKey]:
        return list(self._buckets)

    # ---- selection -----------------------------------------------------------------------
    def select(self, plan: StepPlan, seqs: Sequence[SeqInput]) -> BucketKey | None:
        """The bucket this step runs in, or None for the eager path (counted as a fallback)."""
        key = self._match(plan, seqs)
        if key is None:
            self.stats.fallbacks += 1
        return key

    def _match(self, plan: StepPlan, seqs: Sequence[SeqInput]) -> BucketKey | None:
        if plan.preemptible or self.config.record_op_times or not seqs:
            return None
        if all(s.is_decode for s in seqs):
            return self.grid.decode(len(seqs), max(s.start + 1 for s in seqs))
        if plan.padded_shape is None or any(s.is_decode or s.start != 0 for s in seqs):
            return None
        length, batch = plan.padded_shape
        return self.grid.prefill(max(length, max(len(s.token_ids) for s in seqs)), max(batch, len(seqs)))

    # ---- running ---------------------------------------------------------------------------
    def run(self, key: BucketKey, seqs: Sequence[SeqInput], tables: Sequence[list[int]]) -> torch.Tensor:
        """Run ``seqs`` (block ``tables`` in the same order) in bucket ``key``; returns the logits
        of the sampled sequences, in order (``[num_sampled, vocab]``, fp32)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._make(key)
        self._fill(bucket, seqs, tables)
        if self._capture_graphs:
            if bucket.graph is None:
                self._capture(bucket)
            bucket.graph.replay()
            self.stats.replays += 1
            logits = bucket.output
        else:
            logits = self._forward(bucket)
            self.stats.static_eager += 1
        self.stats.runs[key] += 1
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if rows == list(range(len(rows))):       # the usual case: copied out without an index upload
            return logits[:len(rows)].clone()
        return logits.index_select(0, upload(torch.tensor(rows, dtype=torch.long), self.device))

    def _make(self, key: BucketKey) -> _Bucket:
        if key.kind == DECODE and self.paged_attention is not None:
            return _Bucket(key, self.block_size, self.device, None, None, paged=True)
        if key.kind == DECODE and self._k_workspace is None:
            # one gather workspace for every decode bucket, sized once for the largest (a captured
            # graph bakes in its address, so it must never be reallocated)
            shape = (self.grid.max_decode_rows, self.cache.num_kv_heads, self.cache.head_dim)
            self._k_workspace = torch.zeros(shape, dtype=self.cache.data.dtype, device=self.device)
            self._v_workspace = torch.zeros(shape, dtype=self.cache.data.dtype, device=self.device)
        return _Bucket(key, self.block_size, self.device, self._k_workspace, self._v_workspace)

    def _fill(self, bucket: _Bucket, seqs: Sequence[SeqInput], tables: Sequence[list[int]]) -> None:
        key, bs = bucket.key, self.block_size
        width = bucket.tables.shape[1]
        ids: list[int] = []
        lens: list[int] = []
        flat_tables: list[int] = []
        for s, table in zip(seqs, tables):
            n = s.start + 1 if key.kind == DECODE else len(s.token_ids)
            used = -(-n // bs)
            if n > key.length or used > len(table):
                raise ValueError(f"request {s.request.request_id}: {n} tokens do not fit bucket {key} "
                                 f"with {len(table)} blocks")
            lens.append(n)
            flat_tables.extend(table[:used])
            flat_tables.extend([self.scratch_block] * (width - used))
            if key.kind == DECODE:
                ids.append(s.token_ids[0])
            else:
                ids.extend(s.token_ids)
                ids.extend([0] * (key.length - n))
        pad = key.batch - len(seqs)
        lens.extend([0] * pad)
        flat_tables.extend([self.scratch_block] * (width * pad))
        ids.extend([0] * (key.rows - len(ids)))
        copy_in(bucket.input_ids, torch.tensor(ids, dtype=torch.long))
        copy_in(bucket.lens, torch.tensor(lens, dtype=torch.long))
        copy_in(bucket.tables, torch.tensor(flat_tables, dtype=torch.long).view(key.batch, width))

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """Static metadata from the filled inputs, then the model forward. Capture-safe."""
        bs, scratch, step, meta = self.block_size, self.scratch_slot, bucket.step, bucket.meta
        lens = bucket.lens
        attention = self.attention
        if bucket.paged is not None:                  # decode on the paged kernel: no gather index, no mask
            bucket.paged.copy_(lens.clamp(min=1))     # padding rows: one key in the scratch block
            attention = self.paged_attention
        else:
            valid = bucket.col[None, :] < lens[:, None]                                  # [B, length]
            slots = bucket.tables.index_select(1, bucket.col_block) * bs + bucket.col_offset   # [B, length]
            sees = valid | bucket.first_col[None, :]
        if bucket.key.kind == DECODE:
            if bucket.paged is None:
                meta.gather_index.copy_(torch.where(valid, slots, scratch).view(-1))
                meta.mask.copy_(sees[:, None, None, :])
            last = (lens - 1).clamp(min=0)
            step.positions.copy_(last)
            write = bucket.tables.gather(1, (last // bs)[:, None]).squeeze(1) * bs + last % bs
            step.slots.copy_(torch.where(lens > 0, write, scratch))
        else:
            step.slots.copy_(torch.where(valid, slots, scratch).view(-1))
            meta.mask.copy_((bucket.causal[None, :, :] & sees[:, None, :])[:, None])
            step.logit_rows.copy_(bucket.row_base + lens.clamp(min=1) - 1)
        return _drain(self.model.steps(step, self.cache, attention))

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream, then capture into the shared pool (CUDA only)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(_WARMUP_RUNS):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        # thread-local capture: another instance thread of the same process (LocalCluster) may
        # synchronise or allocate while this one captures; the default global mode would make
        # those calls fail ("operation not permitted when stream is capturing")
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode=CAPTURE_ERROR_MODE):
            bucket.output = self._forward(bucket)
        if self._pool is None:
            self._pool = graph.pool()
        bucket.graph = graph
        self.stats.captures += 1


def _drain(forward: Generator[str, None, torch.Tensor]) -> torch.Tensor:
    """Run an operator generator to its end without stopping; returns its value."""
    while True:
        try:
            next(forward)
        except StopIteration as done:
            return done.value
