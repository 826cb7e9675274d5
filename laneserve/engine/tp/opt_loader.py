"""One rank's shard of an OPT checkpoint (``models/opt.py`` describes the split), read by slices
through :class:`~laneserve.engine.tp.loader.SliceReader` like the Llama shards: column-parallel
fused Q/K/V and ``fc1`` (with their biases) take this rank's rows, row-parallel ``out_proj`` and
``fc2`` take its columns (biases on rank 0 only, so the all-reduce adds them once), the token
embedding and LM head take its vocab part; LayerNorms, positions and the projections are whole.
"""

from __future__ import annotations

import torch

from laneserve.engine.models.opt import OPTEmbeddings, OPTLayerWeights, OPTModel
from laneserve.engine.tp.layout import RankLayout


def _norm(r, name: str, affine: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (r.full(name + ".weight"), r.full(name + ".bias")) if affine else (None, None)


def _layer(r, lay: RankLayout, prefix: str) -> OPTLayerWeights:
    cfg = lay.cfg
    a = prefix + "self_attn."
    heads = lay.dims(lay.heads, cfg.head_dim)          # MHA: the K and V heads are the query heads
    inter = lay.dims(lay.intermediate, 1)
    bias, first, affine = cfg.qkv_bias, lay.rank == 0, cfg.opt.norm_affine

    def qkv(suffix: str) -> torch.Tensor:
        return torch.cat([r.rows(f"{a}{p}_proj{suffix}", heads) for p in "qkv"])

    return OPTLayerWeights(
        attn_norm=_norm(r, prefix + "self_attn_layer_norm", affine),
        qkv=qkv(".weight"), qkv_bias=qkv(".bias") if bias else None,
        o_proj=r.cols(a + "out_proj.weight", heads), o_bias=r.full(a + "out_proj.bias") if bias and first else None,
        mlp_norm=_norm(r, prefix + "final_layer_norm", affine),
        fc1=r.rows(prefix + "fc1.weight", inter), fc1_bias=r.rows(prefix + "fc1.bias", inter) if bias else None,
        fc2=r.cols(prefix + "fc2.weight", inter), fc2_bias=r.full(prefix + "fc2.bias") if bias and first else None,
    )


def load_opt_shard(reader, lay: RankLayout, local_cfg, comm, tokenizer: object | None, path: str) -> OPTModel:
    """Rank ``lay.rank``'s :class:`OPTModel` from ``reader``'s checkpoint, communicating through
    ``comm``; ``local_cfg`` is the config with this rank's head count and MLP width."""
    cfg, opt = lay.cfg, lay.cfg.opt
    d = "model.decoder." if reader.has("model.decoder.embed_tokens.weight") else "decoder."
    layers = [_layer(reader, lay, f"{d}layers.{i}.") for i in range(cfg.num_layers)]
    tokens = reader.vocab_rows(d + "embed_tokens.weight", lay.vocab, cfg.vocab_size)
    if reader.has("lm_head.weight"):
        lm_head = reader.vocab_rows("lm_head.weight", lay.vocab, cfg.vocab_size)
    elif cfg.tie_word_embeddings:
        lm_head = tokens
    else:
        raise KeyError(f"{path}: checkpoint lacks weight 'lm_head.weight'")
    projected = opt.embed_dim != cfg.hidden_size
    emb = OPTEmbeddings(
        tokens=tokens, positions=reader.full(d + "embed_positions.weight"),
        project_in=reader.full(d + "project_in.weight") if projected else None,
        project_out=reader.full(d + "project_out.weight") if projected else None,
        final_norm=_norm(reader, d + "final_layer_norm", opt.norm_affine) if opt.final_norm else None,
        lm_head=lm_head)
    model = OPTModel(local_cfg, emb, layers, tokenizer=tokenizer, path=path)
    model.comm = comm if lay.tp > 1 else None
    model.vocab_start = lay.vocab.start
    model.elements_read = reader.elements_read  # type: ignore[attr-defined]
    return model
