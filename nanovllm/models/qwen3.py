"""Qwen3 and Qwen2 decoders. They differ only in attention: Qwen3 normalises q and k per head,
Qwen2 has q/k/v biases."""
import torch
from torch import nn

from nanovllm.config import ModelConfig
from nanovllm.layers.attention import Attention
from nanovllm.layers.custom_mlp import CustomGatedMLP
from nanovllm.layers.embed_head import LMHead, VocabEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear, tensor_parallel_rank_and_size
from nanovllm.layers.rotary_embedding import RotaryEmbedding


class QwenAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        tp_size = tensor_parallel_rank_and_size()[1]
        self.q_size = config.num_attention_heads // tp_size * config.head_dim  # this rank's heads
        self.kv_size = config.num_key_value_heads // tp_size * config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.attn = Attention(scale=config.head_dim ** -0.5)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else ()
        return self.o_proj(self.attn(positions, q, k, v, self.rotary_emb.cos_sin_cache, *norms).flatten(1))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = QwenAttention(config)
        self.mlp = CustomGatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class QwenModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(QwenDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return self.norm(hidden_states, residual)[0]


class QwenForCausalLM(nn.Module):
    # checkpoint name fragment -> (parameter name fragment, shard id in the merged parameter)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = QwenModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


MODEL_REGISTRY = {"Qwen3ForCausalLM": QwenForCausalLM, "Qwen2ForCausalLM": QwenForCausalLM}
