"""Qwen3-MoE and Qwen2-MoE: Qwen3's and Qwen2's attention with a mixture-of-experts MLP
(layers.fused_moe) in the layers the config makes sparse (decoder_sparse_step,
mlp_only_layers), the dense gated MLP of intermediate_size in the others. Qwen2-MoE adds a
shared expert to every sparse layer and, like Qwen2, has q/k/v biases and none on o_proj."""
from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions
from nanovllm.models.model_config import ModelConfig


def sparse_mlp(config: ModelConfig, layer_idx: int) -> SparseMoeBlock | None:
    if not config.is_moe_layer(layer_idx):
        return None
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, config.norm_topk_prob, config.hidden_act,
                          config.shared_expert_intermediate_size)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    # transformers' Qwen3MoeConfig defaults
    hf_defaults = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                       decoder_sparse_step=1, mlp_only_layers=[])

    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                              mlp=sparse_mlp)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    # transformers' Qwen2MoeConfig defaults
    hf_defaults = dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                       decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=5632)

    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False, mlp=sparse_mlp)
