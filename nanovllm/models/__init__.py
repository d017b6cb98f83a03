"""The model families the engine runs, by the architecture name in a config.json. A family is
one module here (usually a DecoderForCausalLM subclass) and one line below."""
from nanovllm.models.gemma import GemmaForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
}
