"""The torch engine (docs/design.md, "What laneserve is": the engine that runs real Hugging Face
checkpoints with a paged KV cache). ``EngineExecutor.execute(plan)`` is the real counterpart of the
simulator's executor."""

from laneserve.engine.attention import ATTENTION_BACKENDS, register_attention
from laneserve.engine.config import EngineConfig
from laneserve.engine.executor import EngineExecutor, EngineStepResult
from laneserve.engine.kv_cache import KVPayload, PagedKVCache
from laneserve.engine.models import LlamaModel, ModelConfig, UnsupportedModelError, load_model
from laneserve.engine.sampler import Sampler, StopChecker, TokenLogprobs, token_stops

__all__ = [
    "ATTENTION_BACKENDS", "EngineConfig", "EngineExecutor", "EngineStepResult", "KVPayload", "LlamaModel",
    "ModelConfig", "PagedKVCache", "Sampler", "StopChecker", "TokenLogprobs", "UnsupportedModelError",
    "load_model", "register_attention", "token_stops",
]
