"""The model families the engine runs, by the architecture name in a config.json. A family is
one module here (usually a DecoderForCausalLM subclass) and one line below."""
import json
import os

from nanovllm.models.gemma import GemmaForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def model_config(raw: dict) -> ModelConfig:
    """The ModelConfig of a config.json's contents, with the fields its family's checkpoints
    leave out filled from the family's hf_defaults; an architecture outside the registry is a
    ValueError naming `model`, raised before any other check."""
    architecture = (raw.get("architectures") or ["<none>"])[0]
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"model: architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return ModelConfig.from_dict({**MODEL_REGISTRY[architecture].hf_defaults, **raw})


def model_config_from_dir(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: {model_dir!r} has no config.json")
    with open(path) as f:
        return model_config(json.load(f))
