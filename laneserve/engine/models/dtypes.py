"""The torch dtype a checkpoint loads in (shared by the safetensors, tensor-parallel and GGUF loaders)."""

from __future__ import annotations

import torch

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on CPU (the CPU default: docs/design.md,
    "Measured facts")."""
    if requested != "auto":
        return _TORCH_DTYPES[requested]
    if device.type == "cuda":
        return _TORCH_DTYPES.get(checkpoint_dtype.removeprefix("torch."), torch.float32)
    return torch.float32
