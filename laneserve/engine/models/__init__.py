"""Model implementations (Llama family) and the checkpoint loader."""

from laneserve.engine.models.config import ARCHITECTURES, ModelConfig, UnsupportedModelError
from laneserve.engine.models.llama import LayerWeights, LlamaModel, StepTensors
from laneserve.engine.models.loader import load_model, load_tokenizer

__all__ = ["ARCHITECTURES", "LayerWeights", "LlamaModel", "ModelConfig", "StepTensors", "UnsupportedModelError",
           "load_model", "load_tokenizer"]
