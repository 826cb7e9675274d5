"""Model implementations (Llama family, OPT) and the checkpoint loader."""

from laneserve.engine.models.config import ARCHITECTURES, ModelConfig, UnsupportedModelError
from laneserve.engine.models.llama import LayerWeights, LlamaModel, StepTensors
from laneserve.engine.models.loader import load_model, load_tokenizer
from laneserve.engine.models.opt import OPTModel

__all__ = ["ARCHITECTURES", "LayerWeights", "LlamaModel", "ModelConfig", "OPTModel", "StepTensors",
           "UnsupportedModelError", "load_model", "load_tokenizer"]
