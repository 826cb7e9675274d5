"""Hand-written forward of OPT (``OPTForCausalLM``) under the same contract as
``models/llama.py``: a generator over a flat token stream that yields after each of the five
operators of ``laneserve.costmodel.base.LAYER_OPERATORS`` per layer, on the same paged KV cache
and attention backends, so batching, chunked prefill, operator-level preemption and the shape
buckets (``engine/graphs.py``) run it unchanged. The options it reads are described in
``models/opt_config.py``.

Per layer (pre-LN; the post-LN variant of OPT-350m moves each LayerNorm after its residual add):

* ``qkv_proj``  self-attention LayerNorm, fused Q/K/V projection with bias. The token embedding,
  ``project_in`` and the learned positions are folded into the first one.
* ``attention`` write K/V into the paged cache, attention over the cached context (no rotary).
* ``o_proj``    output projection + bias + residual.
* ``gate_up``   MLP LayerNorm, ``fc1`` + bias, ReLU (the operator the cost model calls gate_up).
* ``down``      ``fc2`` + bias + residual. The final LayerNorm, ``project_out`` and the LM head
  run after the last layer.

Tensor parallelism (``engine/tp``, the shard read by ``engine/tp/opt_loader.py``): a rank holds
its heads' rows of the fused Q/K/V and its ``fc1`` rows, the matching columns of ``out_proj`` and
``fc2`` (their biases on rank 0 only), and its part of the vocabulary in the token embedding and
LM head; LayerNorms, learned positions and ``project_in``/``project_out`` are replicated. The
``out_proj`` and ``fc2`` outputs and the vocab-parallel embedding are summed over the ranks with
one all-reduce each (before a post-LN LayerNorm, which needs the whole sum), and the logits are
gathered to rank 0, as in ``models/llama.py``. ``comm = None`` (one rank) makes those no-ops.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laneserve.engine.attention import AttentionBackend
from laneserve.engine.kv_cache import PagedKVCache
from laneserve.engine.models.config import ModelConfig
from laneserve.engine.models.decoder import DecoderModel
from laneserve.engine.models.llama import StepTensors


@dataclass(slots=True)
class OPTLayerWeights:
    attn_norm: tuple[torch.Tensor | None, torch.Tensor | None]   # LayerNorm (weight, bias); None without affine
    qkv: torch.Tensor                                            # [3 * hidden, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: tuple[torch.Tensor | None, torch.Tensor | None]
    fc1: torch.Tensor                                            # [ffn_dim, hidden]
    fc1_bias: torch.Tensor | None
    fc2: torch.Tensor                                            # [hidden, ffn_dim]
    fc2_bias: torch.Tensor | None


@dataclass(slots=True)
class OPTEmbeddings:
    tokens: torch.Tensor                     # [vocab, word_embed_proj_dim]
    positions: torch.Tensor                  # [max_position_embeddings + offset, hidden]
    project_in: torch.Tensor | None          # [hidden, word_embed_proj_dim]
    project_out: torch.Tensor | None         # [word_embed_proj_dim, hidden]
    final_norm: tuple[torch.Tensor | None, torch.Tensor | None] | None
    lm_head: torch.Tensor                    # [vocab, word_embed_proj_dim] (the token table when tied)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class OPTModel(DecoderModel):
    """Weights plus the operator-by-operator forward; the same attributes the runner, the bucket
    runner and the executor use on :class:`~laneserve.engine.models.llama.LlamaModel`."""

    def __init__(self, config: ModelConfig, emb: OPTEmbeddings, layers: list[OPTLayerWeights],
                 tokenizer: object | None = None, path: str | None = None) -> None:
        if config.opt is None:
            raise ValueError(f"{config.architecture}: not an OPT config")
        super().__init__(config, emb.tokens, emb.lm_head, tokenizer, path)
        self.emb = emb
        self.layers = layers
        self._act = _ACTIVATIONS[config.opt.activation]

    def _norm(self, x: torch.Tensor, wb: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], self.config.rms_norm_eps)

    def _embed(self, batch: StepTensors) -> torch.Tensor:
        h = self._embed_tokens(batch.input_ids)
        if self.emb.project_in is not None:
            h = F.linear(h, self.emb.project_in)
        return h + F.embedding(batch.positions + self.config.opt.position_offset, self.emb.positions)

    def _attend(self, index: int, qkv: torch.Tensor, batch: StepTensors, kv: PagedKVCache,
                attention: AttentionBackend, rows: int) -> torch.Tensor:
        """Cache the real rows' K/V and attend; shape-bucket padding rows get zeros."""
        cfg, n = self.config, batch.num_tokens
        q, k, v = (t.contiguous() for t in qkv.view(-1, 3 * cfg.num_heads, cfg.head_dim)[:n].split(cfg.num_heads, dim=1))
        kv.write(index, batch.slots, k, v)
        k_cache, v_cache = kv.layer(index)
        attn = attention.forward(q, k, v, k_cache, v_cache, batch.attn_meta).reshape(n, cfg.q_size)
        if n != rows:
            attn = torch.cat([attn, attn.new_zeros(rows - n, cfg.q_size)])
        return attn

    def steps(self, batch: StepTensors, kv: PagedKVCache,
              attention: AttentionBackend) -> Generator[str, None, torch.Tensor]:
        """Yields the name of each finished operator; returns the logits ``[len(logit_rows), vocab]``."""
        pre = self.config.opt.pre_norm
        h = self._embed(batch)
        for index, w in enumerate(self.layers):
            # qkv_proj
            qkv = F.linear(self._norm(h, w.attn_norm) if pre else h, w.qkv, w.qkv_bias)
            yield "qkv_proj"
            attn = self._attend(index, qkv, batch, kv, attention, h.shape[0])
            del qkv
            yield "attention"
            h = h + self._reduce(F.linear(attn, w.o_proj, w.o_bias))
            if not pre:
                h = self._norm(h, w.attn_norm)
            del attn
            yield "o_proj"
            act = self._act(F.linear(self._norm(h, w.mlp_norm) if pre else h, w.fc1, w.fc1_bias))
            yield "gate_up"
            h = h + self._reduce(F.linear(act, w.fc2, w.fc2_bias))
            if not pre:
                h = self._norm(h, w.mlp_norm)
            del act
            if index == len(self.layers) - 1:
                break
            yield "down"
        last = h.index_select(0, batch.logit_rows)
        if self.emb.final_norm is not None:
            last = self._norm(last, self.emb.final_norm)
        if self.emb.project_out is not None:
            last = F.linear(last, self.emb.project_out)
        logits = self._logits(last)
        yield "down"
        return logits


def opt_from_checkpoint(take: Callable[..., torch.Tensor | None], names: set[str], cfg: ModelConfig,
                        tokenizer: object | None = None, path: str | None = None) -> OPTModel:
    """The :class:`OPTModel` of a checkpoint whose tensors ``take(name, required=True)`` pops
    (converted to the target device and dtype); ``names`` are the checkpoint's tensor names.
    Accepts both ``model.decoder.*`` (``OPTForCausalLM``) and bare ``decoder.*`` key prefixes."""
    opt = cfg.opt
    assert opt is not None
    d = "model.decoder." if "model.decoder.embed_tokens.weight" in names else "decoder."

    def norm(name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not opt.norm_affine:
            return None, None
        return take(name + ".weight"), take(name + ".bias")

    def fused(a: str, suffix: str, required: bool = True) -> torch.Tensor | None:
        parts = [take(f"{a}{p}_proj{suffix}", required) for p in "qkv"]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]

    bias = cfg.qkv_bias
    layers = []
    for i in range(cfg.num_layers):
        p = f"{d}layers.{i}."
        a = p + "self_attn."
        layers.append(OPTLayerWeights(
            attn_norm=norm(p + "self_attn_layer_norm"), qkv=fused(a, ".weight"),
            qkv_bias=fused(a, ".bias") if bias else None,
            o_proj=take(a + "out_proj.weight"), o_bias=take(a + "out_proj.bias") if bias else None,
            mlp_norm=norm(p + "final_layer_norm"),
            fc1=take(p + "fc1.weight"), fc1_bias=take(p + "fc1.bias") if bias else None,
            fc2=take(p + "fc2.weight"), fc2_bias=take(p + "fc2.bias") if bias else None,
        ))
    projected = opt.embed_dim != cfg.hidden_size
    tokens = take(d + "embed_tokens.weight")
    lm_head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
    emb = OPTEmbeddings(
        tokens=tokens, positions=take(d + "embed_positions.weight"),
        project_in=take(d + "project_in.weight") if projected else None,
        project_out=take(d + "project_out.weight") if projected else None,
        final_norm=norm(d + "final_layer_norm") if opt.final_norm else None,
        lm_head=tokens if lm_head is None else lm_head)
    return OPTModel(cfg, emb, layers, tokenizer=tokenizer, path=path)  # type: ignore[arg-type]
