"""Mixture-of-experts options of a Hugging Face ``config.json`` (Qwen3-MoE, Mixtral), read into
plain fields of :class:`~laneserve.engine.models.config.ModelConfig`. Kept apart from the dense
options so the config reader stays one table plus one call per family (no torch here).

* Mixtral: every layer is sparse, ``num_local_experts`` experts of ``intermediate_size``, top-k
  weights always renormalised.
* Qwen3-MoE: ``num_experts`` experts of ``moe_intermediate_size`` (transformers 5 writes the count
  as ``num_local_experts``); layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``, the other layers are dense MLPs of ``intermediate_size``;
  top-k weights renormalised only when ``norm_topk_prob``.
"""

from __future__ import annotations


def moe_options(architecture: str, raw: dict) -> dict:
    """The MoE fields for ``ModelConfig`` (empty for a dense architecture); raises ``ValueError``
    on inconsistent values."""
    if architecture == "MixtralForCausalLM":
        experts = int(raw.get("num_local_experts", 8))
        size, renorm, sparse = int(raw["intermediate_size"]), True, list(range(raw["num_hidden_layers"]))
    elif architecture == "Qwen3MoeForCausalLM":
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        size = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        renorm = bool(raw.get("norm_topk_prob", False))
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = [i for i in range(raw["num_hidden_layers"])
                  if experts > 0 and i not in dense and (i + 1) % step == 0]
    else:
        return {}
    top_k = int(raw.get("num_experts_per_tok", 2))
    if sparse and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=size,
                norm_topk_prob=renorm, moe_layers=tuple(sparse))
