"""Checkpoint loader: a Hugging Face folder (``config.json``, ``*.safetensors`` — single file or
sharded with ``model.safetensors.index.json`` — and optionally a tokenizer with its chat template)
into a :class:`~laneserve.engine.models.llama.LlamaModel` with fused Q/K/V and gate/up weights,
or an :class:`~laneserve.engine.models.opt.OPTModel` for an OPT checkpoint (the architecture's
``ArchSpec.family`` picks the builder).
A GGUF file (llama.cpp's single-file format) goes to ``models/gguf.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from laneserve.engine.models.config import ARCHITECTURES, ModelConfig
from laneserve.engine.models.dtypes import resolve_dtype
from laneserve.engine.models.llama import LayerWeights, LlamaModel
from laneserve.engine.models.moe import moe_from_checkpoint
from laneserve.engine.models.opt import OPTModel, opt_from_checkpoint

log = logging.getLogger(__name__)



def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise FileNotFoundError(f"{folder}: only PyTorch .bin/.pt weights found; laneserve reads *.safetensors")
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    return files


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(folder):
        state.update(load_file(str(f)))
    return state


def load_tokenizer(folder: Path) -> object | None:
    """``transformers.AutoTokenizer`` from the folder when it holds tokenizer files (or from a GGUF
    file), else ``None`` (the engine works on token ids; text in/out needs a tokenizer)."""
    from laneserve.engine.models.gguf import is_gguf_file, load_gguf_tokenizer

    if is_gguf_file(folder):
        return load_gguf_tokenizer(folder)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
               load_tokenizer_too: bool = True) -> LlamaModel | OPTModel:
    from laneserve.engine.models.gguf import is_gguf_file, load_gguf_model

    folder = Path(path)
    if is_gguf_file(folder):
        return load_gguf_model(folder, device, dtype, load_tokenizer_too)
    if folder.is_file():
        raise ValueError(f"model path {folder} is a file but not a GGUF file (it does not start with the "
                         "GGUF magic bytes); pass a GGUF file or a checkpoint folder")
    if not folder.is_dir():
        raise FileNotFoundError(f"model path {folder} is not a folder")
    cfg = ModelConfig.from_folder(folder)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg.checkpoint_dtype, dev)
    state = read_state_dict(folder)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = state.pop(name, None)
        if t is None:
            if required:
                raise KeyError(f"{folder}: checkpoint lacks weight {name!r} (architecture {cfg.architecture})")
            return None
        return t.to(device=dev, dtype=torch_dtype)

    def cat(*names: str, required: bool = True) -> torch.Tensor | None:
        parts = [take(n, required) for n in names]
        if any(p is None for p in parts):
            return None
        return torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]

    tokenizer = load_tokenizer(folder) if load_tokenizer_too else None
    if ARCHITECTURES[cfg.architecture].family == "opt":
        model = opt_from_checkpoint(take, set(state), cfg, tokenizer, str(folder))
        _warn_unused(folder, state)
        return model
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        moe = moe_from_checkpoint(take, p, cfg) if i in cfg.moe_layers else None
        dense = moe is None
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", required=cfg.qkv_bias),
            q_norm=take(a + "q_norm.weight", cfg.qk_norm) if cfg.qk_norm else None,
            k_norm=take(a + "k_norm.weight", cfg.qk_norm) if cfg.qk_norm else None,
            o_proj=take(a + "o_proj.weight"),
            o_bias=take(a + "o_proj.bias", cfg.o_bias) if cfg.o_bias else None,
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight") if dense else None,
            gate_up_bias=cat(m + "gate_proj.bias", m + "up_proj.bias", required=cfg.mlp_bias) if cfg.mlp_bias and dense else None,
            down=take(m + "down_proj.weight") if dense else None,
            down_bias=take(m + "down_proj.bias", cfg.mlp_bias) if cfg.mlp_bias and dense else None,
            moe=moe,
        ))
    embed = take("model.embed_tokens.weight")
    final_norm = take("model.norm.weight")
    lm_head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
    if lm_head is None:
        lm_head = embed
    _warn_unused(folder, state)
    return LlamaModel(cfg, embed, layers, final_norm, lm_head, tokenizer=tokenizer, path=str(folder))  # type: ignore[arg-type]


def _warn_unused(folder: Path, state: dict[str, torch.Tensor]) -> None:
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        log.warning("%s: %d checkpoint tensors unused, e.g. %s", folder, len(leftover), leftover[:3])
