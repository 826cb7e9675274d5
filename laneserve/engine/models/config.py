"""Model configuration read from a Hugging Face ``config.json`` (Llama family: Llama 2/3,
Qwen2/2.5, Qwen3, Mistral without sliding window; the MoE members Qwen3-MoE and Mixtral; and
OPT, whose options are read by ``models/opt_config.py``).

transformers 5.x writes the rotary settings under ``rope_parameters`` (``rope_theta``,
``rope_type`` and the scaling keys); 4.x wrote ``rope_theta`` and ``rope_scaling`` at the top
level. Both are read (docs/design.md, "Measured facts").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from laneserve.engine.models.config_values import UnsupportedModelError, as_ids

__all__ = ["ARCHITECTURES", "ArchSpec", "ModelConfig", "UnsupportedModelError"]

if TYPE_CHECKING:
    from laneserve.engine.models.opt_config import OPTOptions


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """What distinguishes one member of the family from another."""

    qkv_bias_default: bool = False   # Qwen2 always has q/k/v biases
    qk_norm: bool = False            # Qwen3 RMS-normalises q and k per head
    moe: bool = False                # sparse MLP layers (models/moe_config.py)
    family: str = "llama"            # which forward runs it: "llama" (models/llama.py) or "opt" (models/opt.py)


#: architecture name (config.json ``architectures[0]``) -> its spec
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias_default=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, moe=True),
    "MixtralForCausalLM": ArchSpec(moe=True),
    "OPTForCausalLM": ArchSpec(family="opt"),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    #: rotary scaling parameters (``rope_type`` plus its keys) or ``None`` for plain RoPE
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    #: mixture of experts (0 experts = dense): the sparse layers' indices, each routing a token to
    #: ``experts_per_token`` of ``num_experts`` MLPs of ``moe_intermediate_size``
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    #: OPT's own options (learned positions, LayerNorm placement, embedding projection); None
    #: for the Llama family. ``rms_norm_eps`` is then the LayerNorm epsilon.
    opt: OPTOptions | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch or '(none in config.json)'!r} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}")
        spec = ARCHITECTURES[arch]
        if spec.family == "opt":
            from laneserve.engine.models.opt_config import opt_config_fields

            return cls(**opt_config_fields(arch, raw, generation))
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        if raw.get("use_sliding_window") or (arch in ("MistralForCausalLM", "MixtralForCausalLM")
                                             and raw.get("sliding_window")):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("pretraining_tp > 1 is not supported")
        rope_params = dict(raw.get("rope_parameters") or {})
        theta = rope_params.pop("rope_theta", None)
        if theta is None:
            theta = raw.get("rope_theta", 10000.0)
        scaling = rope_params or raw.get("rope_scaling") or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.pop("rope_type", None) or scaling.pop("type", "default")
            scaling.pop("type", None)
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = as_ids(raw.get("eos_token_id")) + as_ids((generation or {}).get("eos_token_id"))
        return cls(
            architecture=arch, model_type=raw.get("model_type", ""), vocab_size=raw["vocab_size"],
            hidden_size=hidden, intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", spec.qkv_bias_default)) or spec.qkv_bias_default,
            o_bias=bool(raw.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=spec.qk_norm,
            eos_token_ids=tuple(dict.fromkeys(eos)), bos_token_id=raw.get("bos_token_id"),
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            extra={k: raw[k] for k in ("name_or_path",) if k in raw},
            **(_moe_options(arch, raw) if spec.moe else {}),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if folder.is_file():
            raise UnsupportedModelError(f"{folder} is a file, not a checkpoint folder (a GGUF file loads on "
                                        "one rank only: tensor parallelism needs a safetensors folder)")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json (is this a Hugging Face checkpoint folder?)")
        raw = json.loads(cfg_path.read_text())
        gen_path = folder / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(raw, generation)


def _moe_options(arch: str, raw: dict) -> dict:
    from laneserve.engine.models.moe_config import moe_options

    try:
        return moe_options(arch, raw)
    except ValueError as exc:
        raise UnsupportedModelError(f"{arch}: {exc}") from exc

