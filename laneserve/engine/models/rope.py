"""Rotary position embeddings (RoPE, Su et al. 2021) with the scalings the Llama family uses:
plain, ``linear`` (position interpolation) and ``llama3`` (Llama 3.1's frequency-banded
rescaling). The "rotate half" layout matches Hugging Face checkpoints: the first and second halves
of each head form the (real, imaginary) pairs.
"""

from __future__ import annotations

import math

import torch

from laneserve.engine.models.config import ModelConfig, UnsupportedModelError


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies (``head_dim // 2``) and the attention scaling applied to cos/sin."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, and the band between
    ``original/low_freq_factor`` and ``original/high_freq_factor`` wavelengths interpolated."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original = float(s["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    long_cutoff = original / low      # wavelengths above this are fully scaled
    short_cutoff = original / high    # wavelengths below this are kept
    scaled = torch.where(wavelength > long_cutoff, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)
    interpolated = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelength >= short_cutoff) & (wavelength <= long_cutoff)
    return torch.where(in_band, interpolated, scaled)


class Rotary:
    """Computes cos/sin for a step's positions once; every layer applies them."""

    __slots__ = ("inv_freq", "attention_scaling")

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        inv_freq, self.attention_scaling = inverse_frequencies(cfg)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, head_dim]`` cos and sin (computed in fp32, cast to the model dtype)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[T, heads, head_dim]``; cos/sin: ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
