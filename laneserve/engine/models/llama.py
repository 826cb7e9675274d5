"""Hand-written forward of the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) over a flat
token stream, written as a generator that yields after every operator so a prefill can be
preempted and resumed at operator boundaries (FlowPrefill §4; docs/design.md, "The central contract").

Per layer the operators are those of ``laneserve.costmodel.base.LAYER_OPERATORS``:

* ``qkv_proj``  input RMSNorm, fused Q/K/V projection (+bias for Qwen2), per-head q/k RMSNorm
  (Qwen3), rotary embedding. The embedding lookup is folded into the first one.
* ``attention`` write the new K/V into the paged cache, attention over the cached context.
* ``o_proj``    output projection + residual.
* ``gate_up``   post-attention RMSNorm, fused gate/up projection, SiLU(gate) * up.
* ``down``      down projection + residual. The final norm + LM head run after the last one.

A sparse (MoE) layer runs its router and experts as the same two operators (``models/moe.py``).

All tokens of a step (several prefill chunks and decodes) are rows of one ``[T, hidden]`` tensor;
only attention looks at sequence boundaries.

Tensor parallelism (``engine/tp``): a sharded model holds its rank's heads, MLP columns and vocab
part, and ``comm`` is its communicator: the row-parallel ``o_proj`` and ``down`` outputs (whatever
computed them) and the vocab-parallel embedding are summed over the ranks with one all-reduce
each, and the logits are gathered to rank 0. ``comm = None`` (one rank) makes those no-ops.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laneserve.engine.attention import AttentionBackend
from laneserve.engine.kv_cache import PagedKVCache
from laneserve.engine.models.config import ModelConfig
from laneserve.engine.models.decoder import DecoderModel
from laneserve.engine.models.moe import MoEWeights, moe_down, moe_gate_up
from laneserve.engine.models.rope import Rotary, apply_rotary


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor                  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None        # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None       # [2 * intermediate, hidden] (None in a sparse layer)
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    moe: MoEWeights | None = None      # a sparse layer's router and experts (models/moe.py)


@dataclass(slots=True)
class StepTensors:
    """The device tensors of one step (built once, shared by every layer)."""

    input_ids: torch.Tensor       # [T_rows] (rows beyond num_tokens are shape-bucket padding)
    positions: torch.Tensor       # [T_rows]
    slots: torch.Tensor           # [num_tokens] flat cache slots of the real tokens
    num_tokens: int
    logit_rows: torch.Tensor      # rows whose logits are needed (last token of sampled sequences)
    attn_meta: object


class LlamaModel(DecoderModel):
    """Weights plus the operator-by-operator forward. Not an ``nn.Module``: plain tensors and
    ``torch.nn.functional`` calls, run under ``torch.inference_mode``."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, tokenizer: object | None = None,
                 path: str | None = None) -> None:
        super().__init__(config, embed, lm_head, tokenizer, path)
        self.layers = layers
        self.final_norm = final_norm
        self.rotary = Rotary(config, embed.device)

    def steps(self, batch: StepTensors, kv: PagedKVCache,
              attention: AttentionBackend) -> Generator[str, None, torch.Tensor]:
        """Yields the name of each finished operator; returns the logits ``[len(logit_rows), vocab]``."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        hidden_size, head_dim = cfg.hidden_size, cfg.head_dim
        n = batch.num_tokens
        h = self._embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for index, w in enumerate(self.layers):
            # qkv_proj
            x = F.rms_norm(h, (hidden_size,), w.input_norm, eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
            q = q.view(-1, cfg.num_heads, head_dim)
            k = k.view(-1, cfg.num_kv_heads, head_dim)
            v = v.view(-1, cfg.num_kv_heads, head_dim)
            if w.q_norm is not None:
                q = F.rms_norm(q, (head_dim,), w.q_norm, eps)
                k = F.rms_norm(k, (head_dim,), w.k_norm, eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            yield "qkv_proj"
            # attention (only the real rows; shape-bucket padding rows get zeros)
            k_real, v_real = k[:n], v[:n].contiguous()
            kv.write(index, batch.slots, k_real, v_real)
            k_cache, v_cache = kv.layer(index)
            attn = attention.forward(q[:n], k_real, v_real, k_cache, v_cache, batch.attn_meta)
            attn = attn.reshape(n, cfg.q_size)
            if attn.shape[0] != h.shape[0]:
                attn = torch.cat([attn, attn.new_zeros(h.shape[0] - n, cfg.q_size)])
            del q, k, v, qkv, x, k_real, v_real
            yield "attention"
            # o_proj
            h = h + self._reduce(F.linear(attn, w.o_proj, w.o_bias))
            del attn
            yield "o_proj"
            # gate_up
            x = F.rms_norm(h, (hidden_size,), w.post_norm, eps)
            if w.moe is not None:
                act = moe_gate_up(x, w.moe)
            else:
                gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
                act = F.silu(gate) * up
                del gate, up
            del x
            yield "gate_up"
            # down (+ final norm and LM head after the last layer)
            h = h + self._reduce(moe_down(act, w.moe) if w.moe is not None else F.linear(act, w.down, w.down_bias))
            del act
            if index == len(self.layers) - 1:
                break
            yield "down"
        last = h.index_select(0, batch.logit_rows)
        logits = self._logits(F.rms_norm(last, (hidden_size,), self.final_norm, eps))
        yield "down"
        return logits
