"""OPT (``OPTForCausalLM``) options of a Hugging Face ``config.json``, read into the fields of
:class:`~laneserve.engine.models.config.ModelConfig` (no torch here).

OPT differs from the Llama family in ways the forward must know (``models/opt.py``): learned
absolute positions (the table has ``max_position_embeddings + 2`` rows: ids are offset by 2),
LayerNorm with bias instead of RMSNorm, a plain ``fc1 -> ReLU -> fc2`` MLP, biases everywhere
(``enable_bias``), LayerNorm before each block (``do_layer_norm_before``, most sizes) or after
the residual add (OPT-350m), and, when ``word_embed_proj_dim`` differs from the hidden size,
``project_in`` / ``project_out`` matrices around the decoder (the embedding and LM head then
live in the smaller dimension). The final LayerNorm exists only in the pre-LN variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneserve.engine.models.config_values import UnsupportedModelError, as_ids

#: ``activation_function`` values the forward implements (transformers' ACT2FN names)
ACTIVATIONS = ("relu", "gelu")
#: learned-position ids are ``position + POSITION_OFFSET`` (a fairseq padding convention)
POSITION_OFFSET = 2
#: transformers' ``nn.LayerNorm`` default, which OPT does not override
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class OPTOptions:
    pre_norm: bool                 # do_layer_norm_before
    embed_dim: int                 # word_embed_proj_dim (== hidden size: no projection)
    final_norm: bool               # a final LayerNorm after the last layer (pre-LN only)
    norm_affine: bool              # layer_norm_elementwise_affine
    activation: str                # "relu" or "gelu"
    position_offset: int = POSITION_OFFSET


def opt_config_fields(arch: str, raw: dict, generation: dict | None) -> dict:
    """The ``ModelConfig`` keyword arguments of an OPT ``config.json``; raises
    :class:`UnsupportedModelError` on an option the forward does not implement."""
    act = raw.get("activation_function", "relu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{arch}: activation_function {act!r} is not supported "
                                    f"(supported: {', '.join(ACTIVATIONS)})")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if hidden % heads:
        raise UnsupportedModelError(f"{arch}: hidden_size {hidden} is not divisible by "
                                    f"num_attention_heads {heads}")
    pre_norm = bool(raw.get("do_layer_norm_before", True))
    embed_dim = int(raw.get("word_embed_proj_dim") or hidden)
    bias = bool(raw.get("enable_bias", True))
    eos = as_ids(raw.get("eos_token_id")) + as_ids((generation or {}).get("eos_token_id"))
    options = OPTOptions(pre_norm=pre_norm, embed_dim=embed_dim,
                         final_norm=pre_norm and not raw.get("_remove_final_layer_norm", False),
                         norm_affine=bool(raw.get("layer_norm_elementwise_affine", True)), activation=act)
    return dict(
        architecture=arch, model_type=raw.get("model_type", "opt"), vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden, intermediate_size=int(raw.get("ffn_dim", 4 * hidden)),
        num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=LAYER_NORM_EPS, rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False,
        eos_token_ids=tuple(dict.fromkeys(eos)), bos_token_id=raw.get("bos_token_id"),
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        extra={k: raw[k] for k in ("name_or_path",) if k in raw}, opt=options,
    )
