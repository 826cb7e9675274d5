"""The torch engine (docs/design.md, "What laneserve is": the engine that runs real Hugging Face
checkpoints with a paged KV cache). ``EngineExecutor.execute(plan)`` is the real counterpart of the
simulator's executor.

The names below are imported on first use (PEP 562), so that ``laneserve.engine.config`` (what the
server checks its engine options with) does not import torch: the server process then imports
it while its instance processes start, not before it starts them."""

from __future__ import annotations

import importlib

_HOME = {
    "ATTENTION_BACKENDS": "attention", "register_attention": "attention",
    "EngineConfig": "config",
    "EngineExecutor": "executor", "EngineStepResult": "executor",
    "KVPayload": "kv_cache", "PagedKVCache": "kv_cache",
    "LlamaModel": "models", "ModelConfig": "models", "UnsupportedModelError": "models", "load_model": "models",
    "Sampler": "sampler", "StopChecker": "sampler", "TokenLogprobs": "sampler", "token_stops": "sampler",
}

__all__ = [
    "ATTENTION_BACKENDS", "EngineConfig", "EngineExecutor", "EngineStepResult", "KVPayload", "LlamaModel",
    "ModelConfig", "PagedKVCache", "Sampler", "StopChecker", "TokenLogprobs", "UnsupportedModelError",
    "load_model", "register_attention", "token_stops",
]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
