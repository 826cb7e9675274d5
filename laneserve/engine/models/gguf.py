"""GGUF checkpoints (llama.cpp's single-file format) for the Llama-family engine.

One ``.gguf`` file holds the configuration (``<arch>.*`` metadata), the tokenizer with its chat
template (``tokenizer.*``) and the weights, often block-quantized (Q4_1, Q8_0, K-quants...). The
engine computes in float, so each tensor is dequantized at load with the ``gguf`` package, one
tensor at a time from the memory-mapped file, and converted to the engine's dtype right away: at
most one tensor exists in two forms at a time, never the whole model.

Architectures: ``llama``, ``qwen2`` (q/k/v biases) and ``qwen3`` (per-head RMS norms of q and k,
``attn_q_norm`` / ``attn_k_norm``). llama.cpp's converter permutes the rows of the Llama Q and K
projections (its rotary embedding rotates adjacent pairs of a head; Hugging Face's, and this
engine's, rotate its two halves); the permutation is undone here for ``llama`` only, as
``transformers`` does when it reads a GGUF file: the converter writes Qwen2/Qwen3 Q and K
unpermuted (llama.cpp runs those with the "neox" rotary style, halves as here).

The context length is ``<arch>.context_length`` (:func:`context_length`): what ``--max-model-len``
and every request are checked against, as ``max_position_embeddings`` of a folder's config.json.

The tokenizer and its chat template are built by ``transformers`` from the same file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from laneserve.engine.models.config import ModelConfig, UnsupportedModelError
from laneserve.engine.models.dtypes import resolve_dtype
from laneserve.engine.models.llama import LayerWeights, LlamaModel

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

#: GGUF ``general.architecture`` -> the config.json architecture it loads as
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "qwen3": "Qwen3ForCausalLM"}
#: the architectures whose Q/K rows llama.cpp's converter permutes
_PERMUTED_QK = frozenset({"llama"})

#: ``<arch>.<key>`` metadata -> config.json key
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic bytes (whatever its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_reader(path: str | Path):
    """A ``gguf.GGUFReader`` over the file (memory-mapped, read-only)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError(f"{path} is a GGUF file: reading it needs the 'gguf' package "
                          "(pip install -e '.[models]')") from None
    return GGUFReader(str(path), "r")


def context_length(path: str | Path) -> int | None:
    """The file's ``<arch>.context_length`` (its ``max_position_embeddings``), None when absent."""
    reader = open_reader(path)
    value = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    return None if value is None else int(value)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_dict(reader, path: Path) -> dict:
    """The config.json equivalent of the file's metadata (what :meth:`ModelConfig.from_dict` reads)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    names = {t.name for t in reader.tensors}
    raw: dict = {"architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
                 "tie_word_embeddings": "output.weight" not in names,
                 "attention_bias": "blk.0.attn_q.bias" in names, "name_or_path": str(path)}
    for suffix, key in _CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{suffix}")
        if value is not None:
            raw[key] = value
    if "vocab_size" not in raw and "tokenizer.ggml.tokens" in reader.fields:
        raw["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    missing = [k for k in (*_REQUIRED, "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks what gives {', '.join(missing)}")
    _check_supported(reader, path, arch, raw, names)
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    raw["eos_token_id"] = [int(e) for e in dict.fromkeys(eos) if e is not None]
    raw["bos_token_id"] = _field(reader, "tokenizer.ggml.bos_token_id")
    raw["dtype"] = _float_dtype(reader)
    return raw


def _check_supported(reader, path: Path, arch: str, raw: dict, names: set[str]) -> None:
    """UnsupportedModelError for the options of the format this loader does not implement."""
    if (_field(reader, f"{arch}.expert_count") or 0) > 0:
        raise UnsupportedModelError(f"{path}: mixture-of-experts GGUF files are not supported")
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: per-frequency rotary scaling (rope_freqs, Llama 3.1 style) "
                                    "is not supported in GGUF files")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    value_dim = _field(reader, f"{arch}.attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise UnsupportedModelError(f"{path}: value heads of {value_dim} dimensions with key heads of {head_dim} "
                                    "are not supported")
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embedding ({rot} of {head_dim} dimensions) "
                                    "is not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"{path}: GGUF rope scaling {scaling!r} is not supported (only linear)")
        raw["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}


def _float_dtype(reader) -> str:
    """The dtype ``--dtype auto`` picks on CUDA: float32 for an all-F32 file, bfloat16 when the file
    holds BF16 tensors, float16 otherwise (what block-quantization scales are stored in)."""
    types = {t.tensor_type.name for t in reader.tensors}
    if types <= {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in types else "float16"


def _can_dequantize(qtype) -> bool:
    from gguf import GGMLQuantizationType, quants

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    traits = getattr(quants, "_type_traits", None)       # the package's table of the types it handles
    return True if traits is None else qtype in traits


def check_quant_types(reader, path: Path) -> None:
    """One error naming every tensor type of the file the ``gguf`` package cannot dequantize."""
    bad: dict[str, list[str]] = {}
    for t in reader.tensors:
        if not _can_dequantize(t.tensor_type):
            bad.setdefault(t.tensor_type.name, []).append(t.name)
    if bad:
        detail = "; ".join(f"{q} ({len(ns)} tensors, e.g. {ns[0]})" for q, ns in sorted(bad.items()))
        raise UnsupportedModelError(f"{path}: GGUF tensor type(s) the gguf package cannot dequantize: {detail}")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head, rows stored as interleaved pairs
    (0, h, 1, h+1, ...) go back to two halves (0, 1, ..., h-1 | h, ..., 2h-1)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _TensorSource:
    """Dequantizes the file's tensors one by one, into the engine's dtype and device."""

    def __init__(self, reader, path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.path, self.cfg, self.dtype, self.device = path, cfg, dtype, device
        self.permuted_qk = cfg.model_type in _PERMUTED_QK

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        from gguf import dequantize

        t = self.tensors.pop(name, None)
        if t is None:
            if required:
                raise KeyError(f"{self.path}: GGUF file lacks tensor {name!r} ({self.cfg.architecture})")
            return None
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:     # a type check_quant_types could not see in the package
            raise UnsupportedModelError(f"{self.path}: tensor {name}: {exc}") from None
        if self.permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rows(w, self.cfg.num_heads if "attn_q" in name else self.cfg.num_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):   # a view of the read-only mapped file
            w = np.array(w, order="C")
        return torch.from_numpy(w).to(device=self.device, dtype=self.dtype)

    def cat(self, *names: str, required: bool = True) -> torch.Tensor | None:
        parts = [self.take(n, required) for n in names]
        if any(p is None for p in parts):
            return None
        return torch.cat(parts, dim=0).contiguous()  # type: ignore[arg-type]


def _layer(src: _TensorSource, i: int) -> LayerWeights:
    cfg, p = src.cfg, f"blk.{i}."
    return LayerWeights(
        input_norm=src.take(p + "attn_norm.weight"),
        qkv=src.cat(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
        qkv_bias=src.cat(p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias") if cfg.qkv_bias else None,
        q_norm=src.take(p + "attn_q_norm.weight") if cfg.qk_norm else None,
        k_norm=src.take(p + "attn_k_norm.weight") if cfg.qk_norm else None,
        o_proj=src.take(p + "attn_output.weight"),
        o_bias=src.take(p + "attn_output.bias") if cfg.o_bias else None,
        post_norm=src.take(p + "ffn_norm.weight"),
        gate_up=src.cat(p + "ffn_gate.weight", p + "ffn_up.weight"),
        gate_up_bias=None,
        down=src.take(p + "ffn_down.weight"),
        down_bias=None,
    )


def load_gguf_model(path: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
                    load_tokenizer_too: bool = True) -> LlamaModel:
    """A :class:`LlamaModel` from one GGUF file, its weights dequantized tensor by tensor."""
    path = Path(path)
    reader = open_reader(path)
    cfg = ModelConfig.from_dict(config_dict(reader, path))
    check_quant_types(reader, path)
    dev = torch.device(device)
    src = _TensorSource(reader, path, cfg, resolve_dtype(dtype, cfg.checkpoint_dtype, dev), dev)
    layers = [_layer(src, i) for i in range(cfg.num_layers)]
    embed = src.take("token_embd.weight")
    final_norm = src.take("output_norm.weight")
    lm_head = src.take("output.weight", required=not cfg.tie_word_embeddings)
    if lm_head is None:
        lm_head = embed
    if src.tensors:
        log.warning("%s: %d GGUF tensors unused, e.g. %s", path, len(src.tensors), list(src.tensors)[:3])
    has_tokenizer = "tokenizer.ggml.tokens" in reader.fields
    del reader, src
    tokenizer = load_gguf_tokenizer(path) if load_tokenizer_too and has_tokenizer else None
    return LlamaModel(cfg, embed, layers, final_norm, lm_head, tokenizer=tokenizer, path=str(path))  # type: ignore[arg-type]


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) stored in the GGUF file, built by ``transformers``.
    The fast class is named directly: ``AutoTokenizer`` would first parse the whole file once
    more only to pick that class (seconds for a 49k-token vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
