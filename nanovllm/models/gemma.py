"""Gemma (1): GeGLU MLP (the fused gelu_and_mul kernel), RMSNorm scaling by 1 + weight,
embeddings scaled by sqrt(hidden_size) in the model's dtype, head_dim from the config (256 in
the published models), LM head tied to the embedding."""
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class GemmaForCausalLM(DecoderForCausalLM):
    hf_defaults = {"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}

    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, unit_offset_norms=True,
                              embed_scale=config.hidden_size ** 0.5)
