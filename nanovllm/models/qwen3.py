"""Qwen3 and Qwen2. They differ from the plain decoder only in attention: Qwen3 normalises q
and k per head, Qwen2 always has q/k/v biases (and none on o_proj)."""
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False)
