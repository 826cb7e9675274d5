"""Load one rank's shard of a checkpoint: each tensor is read through ``safe_open(...).get_slice``
so a rank reads only its rows or columns, never the whole tensor (a 70B checkpoint's full
tensors do not fit one rank's memory, and reading them N times would cost N times the I/O).

Column-parallel weights (fused Q/K/V, fused gate/up, their biases) take rows; row-parallel ones
(``o_proj``, ``down``) take columns, and their biases are kept on rank 0 only so the all-reduce
adds them once. Norms (including Qwen3's per-head q/k norms) are replicated. The embedding and
LM head take this rank's vocab part, zero-padded where the part runs past the vocabulary.

A sparse (MoE) layer's router is replicated; every expert's gate and up projections take this
rank's rows of the expert intermediate dimension and its down projection the matching columns
(read expert by expert into one stacked buffer), so the layer's output on a rank is a partial sum
that the model's all-reduce after ``down`` completes, exactly as for a dense MLP.
An OPT checkpoint's shard is read by ``tp/opt_loader.py`` on the same rules.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import torch

from laneserve.engine.models.config import ARCHITECTURES, ModelConfig
from laneserve.engine.models.llama import LayerWeights, LlamaModel
from laneserve.engine.models.loader import _safetensor_files, load_tokenizer, resolve_dtype
from laneserve.engine.models.moe import CHECKPOINT_NAMES, MoEWeights
from laneserve.engine.tp.layout import RankLayout


class SliceReader:
    """Tensors of a (possibly sharded) safetensors checkpoint, read by slices."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.device, self.dtype = device, dtype
        self._files = [safe_open(str(f), framework="pt", device="cpu") for f in _safetensor_files(folder)]
        self._where = {name: h for h in self._files for name in h.keys()}
        self.folder = folder
        self.elements_read = 0          # how much was read: the tests check it is a shard, not all

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"{self.folder}: checkpoint lacks weight {name!r}")
        return self._where[name].get_slice(name)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        self.elements_read += t.numel()
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def full(self, name: str) -> torch.Tensor:
        return self._out(self._slice(name)[:])

    def rows(self, name: str, span: tuple[int, int]) -> torch.Tensor:
        return self._out(self._slice(name)[span[0]:span[1]])

    def cols(self, name: str, span: tuple[int, int]) -> torch.Tensor:
        return self._out(self._slice(name)[:, span[0]:span[1]])

    def vocab_rows(self, name: str, part: range, vocab: int) -> torch.Tensor:
        """Rows ``part`` of a ``[vocab, hidden]`` tensor, zero rows past ``vocab``."""
        t = self.rows(name, (min(part.start, vocab), min(part.stop, vocab)))
        if t.shape[0] < len(part):
            t = torch.cat([t, t.new_zeros(len(part) - t.shape[0], *t.shape[1:])])
        return t


def _layer(r: SliceReader, lay: RankLayout, i: int) -> LayerWeights:
    cfg, hd = lay.cfg, lay.cfg.head_dim
    p = f"model.layers.{i}."
    a = p + "self_attn."
    q_span, kv_span = lay.dims(lay.heads, hd), lay.dims(lay.kv_heads, hd)
    first = lay.rank == 0

    def qkv(suffix: str) -> torch.Tensor:
        return torch.cat([r.rows(a + "q_proj" + suffix, q_span), r.rows(a + "k_proj" + suffix, kv_span),
                          r.rows(a + "v_proj" + suffix, kv_span)])

    if i in cfg.moe_layers:
        mlp = dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None, moe=_experts(r, lay, p))
    else:
        mlp = _dense_mlp(r, lay, p + "mlp.")
    return LayerWeights(
        input_norm=r.full(p + "input_layernorm.weight"),
        qkv=qkv(".weight"),
        qkv_bias=qkv(".bias") if cfg.qkv_bias else None,
        q_norm=r.full(a + "q_norm.weight") if cfg.qk_norm else None,
        k_norm=r.full(a + "k_norm.weight") if cfg.qk_norm else None,
        o_proj=r.cols(a + "o_proj.weight", q_span),
        o_bias=r.full(a + "o_proj.bias") if cfg.o_bias and first else None,
        post_norm=r.full(p + "post_attention_layernorm.weight"),
        **mlp,
    )


def _dense_mlp(r: SliceReader, lay: RankLayout, m: str) -> dict:
    """A dense MLP's fields of :class:`LayerWeights`: gate/up rows and down columns of this rank."""
    inter, bias = lay.dims(lay.intermediate, 1), lay.cfg.mlp_bias

    def gate_up(suffix: str) -> torch.Tensor:
        return torch.cat([r.rows(m + "gate_proj" + suffix, inter), r.rows(m + "up_proj" + suffix, inter)])

    return dict(gate_up=gate_up(".weight"), gate_up_bias=gate_up(".bias") if bias else None,
                down=r.cols(m + "down_proj.weight", inter),
                down_bias=r.full(m + "down_proj.bias") if bias and lay.rank == 0 else None)


def _experts(r: SliceReader, lay: RankLayout, layer_prefix: str) -> MoEWeights:
    """A sparse layer's router (whole) and this rank's slice of every expert, stacked
    ``[E, 2 * part, hidden]`` (gate rows, then up rows) and ``[E, hidden, part]``."""
    cfg = lay.cfg
    module, router, gate, up, down = CHECKPOINT_NAMES[cfg.architecture]
    m = f"{layer_prefix}{module}."
    span = lay.dims(lay.expert_intermediate, 1)
    part = span[1] - span[0]
    gate_up = torch.empty(cfg.num_experts, 2 * part, cfg.hidden_size, device=r.device, dtype=r.dtype)
    downs = torch.empty(cfg.num_experts, cfg.hidden_size, part, device=r.device, dtype=r.dtype)
    for e in range(cfg.num_experts):
        x = f"{m}experts.{e}."
        gate_up[e, :part] = r.rows(f"{x}{gate}.weight", span)
        gate_up[e, part:] = r.rows(f"{x}{up}.weight", span)
        downs[e] = r.cols(f"{x}{down}.weight", span)
    return MoEWeights(router=r.full(f"{m}{router}.weight"), gate_up=gate_up, down=downs,
                      top_k=cfg.experts_per_token, renormalize=cfg.norm_topk_prob)


def local_config(lay: RankLayout) -> ModelConfig:
    """The config a rank's forward runs with: its own head counts, MLP and expert widths (the KV
    cache it sizes holds only its KV heads)."""
    return dataclasses.replace(lay.cfg, num_heads=lay.num_heads, num_kv_heads=lay.num_kv_heads,
                               intermediate_size=len(lay.intermediate),
                               moe_intermediate_size=len(lay.expert_intermediate))


def load_shard(path: str | Path, rank: int, tp: int, device: str | torch.device = "cpu",
               dtype: str = "float32", comm=None, load_tokenizer_too: bool = False) -> LlamaModel:
    """Rank ``rank``'s part of the checkpoint at ``path`` as a :class:`LlamaModel` whose ``comm``
    is ``comm`` (None: a single rank)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model path {folder} is not a folder")
    cfg = ModelConfig.from_folder(folder)
    lay = RankLayout(cfg, rank, tp)
    dev = torch.device(device)
    reader = SliceReader(folder, dev, resolve_dtype(dtype, cfg.checkpoint_dtype, dev))
    if ARCHITECTURES[cfg.architecture].family == "opt":
        from laneserve.engine.tp.opt_loader import load_opt_shard

        return load_opt_shard(reader, lay, local_config(lay), comm,  # type: ignore[return-value]
                              load_tokenizer(folder) if load_tokenizer_too else None, str(folder))
    layers = [_layer(reader, lay, i) for i in range(cfg.num_layers)]
    embed = reader.vocab_rows("model.embed_tokens.weight", lay.vocab, cfg.vocab_size)
    head_name = "lm_head.weight"
    if reader.has(head_name):
        lm_head = reader.vocab_rows(head_name, lay.vocab, cfg.vocab_size)
    elif cfg.tie_word_embeddings:
        lm_head = embed
    else:
        raise KeyError(f"{folder}: checkpoint lacks weight {head_name!r}")
    tokenizer = load_tokenizer(folder) if load_tokenizer_too else None
    model = LlamaModel(local_config(lay), embed, layers, reader.full("model.norm.weight"), lm_head,
                       tokenizer=tokenizer, path=str(folder))
    model.comm = comm if tp > 1 else None
    model.vocab_start = lay.vocab.start
    model.vocab_size = cfg.vocab_size
    model.elements_read = reader.elements_read  # type: ignore[attr-defined]
    return model


__all__ = ["SliceReader", "load_shard", "local_config"]
