"""From a core ``StepPlan`` to the tensors of one forward pass, and the resumable forward itself
(docs/design.md, "The central contract"; FlowPrefill §4 operator-level preemption).

The runner reads, never writes, the request counters: a prefill chunk computes tokens
``[chunk.start, chunk.end)`` of the request's full token list (``prompt_token_ids +
output_token_ids``) on top of ``chunk.start`` cached tokens; a decode processes the newest output
token at position ``req.context_len - 1``. Block tables come from the ``KVCacheManager`` the
scheduler allocated in.

Recompute after preemption (vLLM-style; ``policies/decode/base.py``): a request whose KV was
dropped is re-prefilled with ``PrefillChunk(req, 0, req.context_len - 1)`` — prompt plus every
output token but the newest, which the next decode step processes. A chunk samples a token only
when it reaches the end of the known tokens (``chunk.end >= prompt_len + num_output_tokens``): a
fresh prompt's last chunk (the first output token), or a recompute that also covers the newest
output token. A recompute chunk that stops short of it samples nothing and returns no token for
the request (the update rule records none either: ``policies/base.py`` ``_advance_prefill``).

Shape buckets and CUDA graphs (LAPS §3): with ``EngineConfig.cuda_graphs`` the runner also owns a
:class:`~laneserve.engine.graphs.BucketRunner` and the KV cache gets one scratch block that the
``KVCacheManager`` never hands out. :meth:`ModelRunner.select_bucket` sends non-preemptible
decode-only steps and fresh short-prefill steps with a ``plan.padded_shape`` to it — captured and
replayed as CUDA graphs on CUDA, run eagerly on the very same static buffers elsewhere — and every
other step to the resumable path of :meth:`prepare` / :meth:`forward`. The static path (bucket
selection, padding, scratch slot, masks, token identity with the eager path, no host reads inside
the forward) is verified on CPU by ``tests/test_engine_graphs.py``; the capture and replay calls
themselves only run on a CUDA device (``benchmarks/cuda_graphs.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Generator

import torch

from laneserve.core.kv import KVCacheManager
from laneserve.core.plan import StepPlan
from laneserve.engine.attention import AttentionBatch, GatherWorkspace, block_slots, make_attention
from laneserve.engine.config import EngineConfig
from laneserve.engine.device_stream import upload_packed
from laneserve.engine.graphs import BucketKey, BucketRunner
from laneserve.engine.kv_cache import PagedKVCache
from laneserve.engine.models.llama import LlamaModel, StepTensors
from laneserve.engine.sequence import SeqInput

log = logging.getLogger(__name__)


def plan_sequences(plan: StepPlan, kv: KVCacheManager) -> list[SeqInput]:
    """Prefill chunks first, then decodes (the order of the step's rows), validated against the
    block tables."""
    seqs: list[SeqInput] = []
    for chunk in plan.prefills:
        req = chunk.request
        if req.prompt_token_ids is None:
            raise ValueError(f"request {req.request_id}: the engine needs prompt_token_ids "
                             "(trace workloads must be given synthetic token ids)")
        outputs = req.output_token_ids or []
        known = len(req.prompt_token_ids) + len(outputs)
        if chunk.start < 0 or chunk.num_new_tokens < 1 or chunk.end > known:
            raise ValueError(f"request {req.request_id}: chunk [{chunk.start}, {chunk.end}) outside its "
                             f"{len(req.prompt_token_ids)} prompt + {len(outputs)} output tokens")
        _check_blocks(kv, req.request_id, chunk.end)
        seqs.append(SeqInput(req, _token_slice(req.prompt_token_ids, outputs, chunk.start, chunk.end),
                             chunk.start, chunk.end >= known, False))
    for req in plan.decodes:
        if not req.output_token_ids:
            raise ValueError(f"request {req.request_id}: decode without an output token to process")
        ctx = req.context_len
        _check_blocks(kv, req.request_id, ctx)
        seqs.append(SeqInput(req, [req.output_token_ids[-1]], ctx - 1, True, True))
    return seqs


def prompt_logprob_rows(seqs: list[SeqInput]) -> list[tuple[SeqInput, int, int]]:
    """Positions whose logits give prompt logprobs (``sampling.prompt_logprobs``): for each prefill
    sequence that asks, ``(seq, first position, count)`` of its positions ``p`` whose next token
    ``p + 1`` is a prompt token. Their logits follow the sampled rows' (:meth:`ModelRunner.prepare`)."""
    out = []
    for s in seqs:
        p = s.request.sampling
        if s.is_decode or p is None or p.prompt_logprobs is None:
            continue
        end = min(s.start + len(s.token_ids), s.request.prompt_len - 1)
        if end > s.start:
            out.append((s, s.start, end - s.start))
    return out


def _token_slice(prompt: list[int], outputs: list[int], start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of ``prompt + outputs`` without building the concatenation."""
    if end <= len(prompt):
        return prompt[start:end]
    head = prompt[start:] if start < len(prompt) else []
    return head + outputs[max(start - len(prompt), 0):end - len(prompt)]


_KERNEL_CHECKS: dict[tuple, bool] = {}


def paged_kernel_works(model: LlamaModel) -> bool:
    """Run the paged-attention kernel once on a small case in the model's dtype and head layout
    (a decode and a chunk over a cached prefix) and compare it with SDPA: False if it fails to
    compile or run, or disagrees. Remembered per device, dtype and head layout."""
    cfg = model.config
    key = (str(model.device), model.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if key not in _KERNEL_CHECKS:
        _KERNEL_CHECKS[key] = _check_paged_kernel(model)
    return _KERNEL_CHECKS[key]


def _check_paged_kernel(model: LlamaModel) -> bool:
    try:
        from laneserve.engine.triton_attention import paged_attention, paged_meta

        cfg, dev, dtype = model.config, model.device, model.dtype
        g = torch.Generator(device="cpu").manual_seed(0)
        block, q_lens, starts = 16, [1, 5], [20, 11]
        ctx = [s + n for s, n in zip(starts, q_lens)]
        tables = [[3, 0], [1, 2]]
        k = torch.randn(4 * block, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dev, dtype)
        v = torch.randn(4 * block, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dev, dtype)
        q = torch.randn(sum(q_lens), cfg.num_heads, cfg.head_dim, generator=g).to(dev, dtype)
        out = paged_attention(q, k, v, paged_meta(q_lens, ctx, tables, block, dev), block).float()
        row = 0
        for n, s, c, t in zip(q_lens, starts, ctx, tables):
            slots = torch.tensor([t[p // block] * block + p % block for p in range(c)], device=dev)
            mask = torch.arange(c, device=dev)[None, :] <= (s + torch.arange(n, device=dev))[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[row:row + n].float().transpose(0, 1)[None], k[slots].float().transpose(0, 1)[None],
                v[slots].float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
            if not torch.allclose(out[row:row + n], ref, atol=5e-2, rtol=5e-2):
                return False
            row += n
        return True
    except Exception:                 # no Triton, no compiler for this device, a kernel error
        log.exception("paged-attention start-up check")
        return False


def _check_blocks(kv: KVCacheManager, request_id: int, num_tokens: int) -> None:
    have = kv.num_allocated(request_id) * kv.block_size
    if have < num_tokens:
        raise ValueError(f"request {request_id}: {num_tokens} tokens need KV blocks, only {have} token slots allocated")


class ModelRunner:
    """Owns the device KV tensors, the attention path and its workspace."""

    def __init__(self, model: LlamaModel, kv_manager: KVCacheManager, config: EngineConfig) -> None:
        cfg = model.config
        if kv_manager.block_size != config.block_size:
            raise ValueError(f"KV manager block size {kv_manager.block_size} != config.block_size {config.block_size}")
        self.model = model
        self.kv_manager = kv_manager
        self.config = config
        self.device = model.device
        # the bucket path needs one block no request owns (padding rows write there)
        self.cache = PagedKVCache(cfg.num_layers, kv_manager.num_blocks, kv_manager.block_size,
                                  cfg.num_kv_heads, cfg.head_dim, model.dtype, self.device,
                                  scratch_blocks=1 if config.cuda_graphs else 0)
        self.workspace = GatherWorkspace(config.max_num_batched_tokens, cfg.num_kv_heads, cfg.head_dim,
                                         model.dtype, self.device)
        name = config.attention
        if name == "paged" and self.device.type == "cuda" and not paged_kernel_works(model):
            log.warning("the Triton paged-attention kernel failed its start-up check on %s; using the "
                        "ragged attention path", self.device)
            name = "ragged"
        self.attention_name = name
        self.attention = make_attention(name, self.workspace)
        self.graphs: BucketRunner | None = None
        if config.cuda_graphs:
            self.graphs = BucketRunner(model, self.cache, config, paged=name == "paged")
            log.info("cuda_graphs: shape buckets %s on %s", "captured as CUDA graphs" if self.device.type == "cuda"
                     else "run eagerly on static buffers", self.device)

    def select_bucket(self, plan: StepPlan, seqs: list[SeqInput]) -> BucketKey | None:
        """The shape bucket of this step, or None for the resumable eager path (always None
        without ``cuda_graphs``)."""
        return None if self.graphs is None else self.graphs.select(plan, seqs)

    def run_bucket(self, key: BucketKey, seqs: list[SeqInput]) -> torch.Tensor:
        """Run a step in its bucket; returns the logits of the sampled sequences."""
        assert self.graphs is not None
        tables = [self.kv_manager.table(s.request.request_id) for s in seqs]
        return self.graphs.run(key, seqs, tables)

    def prepare(self, seqs: list[SeqInput], padded_shape: tuple[int, int] | None = None,
                prompt_rows: list[tuple[SeqInput, int, int]] = ()) -> StepTensors:
        """The step's tensors; ``prompt_rows`` (:func:`prompt_logprob_rows` of ``seqs``) add the
        logit rows of prompt positions after the sampled rows'.

        Built once per step on the host with vectorised ops (positions and KV write slots from
        per-sequence starts, lengths and block tables) and uploaded in one copy
        (:func:`~laneserve.engine.device_stream.upload_packed`: pinned, non-blocking on CUDA); the
        attention metadata adds its own per-step upload."""
        bs = self.kv_manager.block_size
        lens = [len(s.token_ids) for s in seqs]
        starts = [s.start for s in seqs]
        tables = [self.kv_manager.table(s.request.request_id) for s in seqs]
        ids = [t for s in seqs for t in s.token_ids]
        num_tokens = len(ids)
        first_row: list[int] = []
        logit_rows: list[int] = []
        row = 0
        for s, n in zip(seqs, lens):
            first_row.append(row)
            row += n
            if s.sample:
                logit_rows.append(row - 1)
        row_of = {id(s): r for s, r in zip(seqs, first_row)}
        for s, first, count in prompt_rows:                    # after the sampled rows
            r = row_of[id(s)] + first - s.start
            logit_rows.extend(range(r, r + count))
        pad = 0
        if padded_shape is not None:   # LAPS shape bucket: pad the token rows (linear layers pay for them)
            pad = max(padded_shape[0] * padded_shape[1] - num_tokens, 0)
        lens_t = torch.tensor(lens, dtype=torch.long)
        seq_of_row = torch.repeat_interleave(torch.arange(len(seqs)), lens_t)
        offset = torch.tensor(starts, dtype=torch.long) - torch.tensor(first_row, dtype=torch.long)
        positions = torch.arange(num_tokens) + offset[seq_of_row]
        slots = block_slots(tables, [s + n for s, n in zip(starts, lens)], bs, seq_of_row, positions)
        ids_t = torch.tensor(ids, dtype=torch.long)
        if pad:
            ids_t = torch.cat([ids_t, ids_t.new_zeros(pad)])
            positions_in = torch.cat([positions, positions.new_zeros(pad)])
        else:
            positions_in = positions
        input_ids, positions_d, slots_d, logit_rows_d = upload_packed(
            [ids_t, positions_in, slots, torch.tensor(logit_rows, dtype=torch.long)], self.device)
        batch = AttentionBatch(lens, starts, tables, bs)
        return StepTensors(input_ids=input_ids, positions=positions_d, slots=slots_d, num_tokens=num_tokens,
                           logit_rows=logit_rows_d, attn_meta=self.attention.prepare(batch, self.device))

    def forward(self, step: StepTensors) -> Generator[str, None, torch.Tensor]:
        """The resumable forward: yields after each operator, returns the logits."""
        return self.model.steps(step, self.cache, self.attention)
