"""The pre-norm decoder that Qwen3, Qwen2, Llama, Mistral and Gemma share: attention with
rotary embedding over the paged KV cache, the gated MLP, the decoder layer, the model and the
causal-LM wrapper, whose packed_modules_mapping maps checkpoint names onto the merged
projections. A family subclasses DecoderForCausalLM and states what it does differently in a
DecoderOptions (and, where its transformers config defaults a field differently, in
hf_defaults)."""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nanovllm.models.model_config import ModelConfig
from nanovllm.layers.attention import Attention
from nanovllm.layers.custom_mlp import CustomGatedMLP
from nanovllm.layers.embed_head import LMHead, VocabEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear, tensor_parallel_rank_and_size
from nanovllm.layers.rotary_embedding import RotaryEmbedding


@dataclass(frozen=True)
class DecoderOptions:
    """What a family's decoder does beyond the plain (Llama) one."""
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool = False  # RMSNorm of each q and k head before rotation (Qwen3)
    unit_offset_norms: bool = False  # norms scale by 1 + weight (Gemma)
    embed_scale: float | None = None  # embeddings times this, rounded to the model's dtype (Gemma)
    # (config, layer index) -> that layer's MLP, None where it is the dense gated one (mixtures of experts)
    mlp: Callable[[ModelConfig, int], nn.Module] | None = None


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions, rotary_emb: RotaryEmbedding):
        super().__init__()
        _, tp_size = tensor_parallel_rank_and_size()
        self.head_dim = config.head_dim
        self.q_size = config.num_attention_heads // tp_size * config.head_dim
        self.kv_size = config.num_key_value_heads // tp_size * config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=options.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=options.o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(scale=config.head_dim ** -0.5, sliding_window=config.sliding_window)
        if options.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: qkv_proj's output (the decoder layer runs it, with the norm before it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else ()
        return self.o_proj(self.attn(positions, q, k, v, self.rotary_emb.cos_sin_cache, *norms).flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, options, rotary_emb)
        mlp = options.mlp(config, layer_idx) if options.mlp is not None else None
        if mlp is None:  # the dense gated MLP
            mlp = CustomGatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.unit_offset_norms)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.unit_offset_norms)

    def forward(self, positions, hidden_states, residual):
        # Each norm runs with the projection after it: one kernel in decode steps of one or two
        # sequences (kernels.norm_linear).
        qkv, residual = self.self_attn.qkv_proj.normed_forward(hidden_states, self.input_layernorm, residual)
        return self.from_qkv(positions, qkv, residual)

    def from_qkv(self, positions, qkv, residual):
        """The layer after its qkv projection (the model's first layer computes that projection
        from the token ids)."""
        hidden_states = self.self_attn(positions, qkv)
        return self.mlp.normed_forward(hidden_states, self.post_attention_layernorm, residual)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One table for all layers (Llama 3.1's 131072 positions take 32-64 MiB of fp32).
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                     config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, options, rotary_emb, i) for i in range(config.num_hidden_layers))
        projections = [p for layer in self.layers
                       for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *layer.mlp.projections())]
        for current, following in zip(projections, projections[1:]):
            current.read_ahead(following)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.unit_offset_norms)
        self.embed_scale = None
        if options.embed_scale is not None:
            # Rounded as transformers rounds it: to fp32, then to the model's dtype.
            self.embed_scale = torch.tensor(options.embed_scale, dtype=torch.float32, device="cpu").to(
                self.embed_tokens.weight.dtype).item()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        first = self.layers[0]
        if self.embed_tokens.tp_size == 1:  # the lookup inside the first projection's kernel, where it fuses
            qkv, residual = first.self_attn.qkv_proj.embedded_forward(input_ids, self.embed_tokens.weight,
                                                                      self.embed_scale, first.input_layernorm)
            hidden_states, residual = first.from_qkv(positions, qkv, residual)
        else:
            hidden_states = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
            hidden_states, residual = first(positions, hidden_states, None)
        for layer in self.layers[1:]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return self.norm(hidden_states, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The plain decoder: q/k/v/o biases as attention_bias says, MLP biases as mlp_bias says."""
    # checkpoint name fragment -> (parameter name fragment, shard id in the merged parameter)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # config.json fields -> the family's transformers default, for files that leave them out
    hf_defaults: dict = {}

    @classmethod
    def options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.model = DecoderModel(config, self.options(config))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
