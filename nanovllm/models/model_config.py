"""What the engine reads of a Hugging Face config.json, as written by transformers 4.x
(rope_theta and rope_scaling, torch_dtype) or 5.x (rope_parameters, dtype). The registry's
nanovllm.models.model_config applies a family's defaults and refuses unknown architectures."""
from dataclasses import dataclass

import torch

from nanovllm.layers.rotary_embedding import ROPE_SCALING_PARAMETERS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Fields every family needs and no default stands in for.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": ..., its parameters}; None: unscaled
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # keys a query sees, its own included; None: all before it
    torch_dtype: torch.dtype
    eos_token_id: list[int]
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Every field check runs here, before a model is built or a weight read: a missing
        field, a rope scaling type or window the engine does not implement each raise a
        ValueError naming the field."""
        architecture = (raw.get("architectures") or ["<none>"])[0]
        for name in REQUIRED_FIELDS:
            if raw.get(name) is None:
                raise ValueError(f"{name}: missing from config.json ({architecture} needs it)")
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal attention is supported")
        max_positions = raw.get("max_position_embeddings", 32768)
        rope_theta, rope_scaling = _rope(raw, max_positions)
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            # Gemma's configs name the activation it was trained with in hidden_activation where
            # their hidden_act says "gelu" (exact), which the first releases carried by mistake.
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw),
            torch_dtype=DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"), torch.bfloat16),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            **_experts(raw),
        )


def _experts(raw: dict) -> dict:
    """The mixture-of-experts fields, checked where num_experts says the model has experts."""
    # transformers 5 writes num_local_experts, published configs num_experts (which the
    # families' defaults also fill)
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if not experts:
        return {}
    fields = dict(num_experts=experts, num_experts_per_tok=raw.get("num_experts_per_tok"),
                  moe_intermediate_size=raw.get("moe_intermediate_size"),
                  norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
                  mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                  shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0)
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if fields["num_experts_per_tok"] > experts:
        raise ValueError(f"num_experts_per_tok: {fields['num_experts_per_tok']} is more than num_experts ({experts})")
    return fields


def _rope(raw: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters (theta inside) or 4.x's
    top-level rope_theta and rope_scaling ("type" in the oldest files)."""
    name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = dict(raw.get(name) or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_SCALING_PARAMETERS:
        raise ValueError(f"{name}: rope_type {rope_type!r} is not implemented; "
                         f"implemented: {', '.join(ROPE_SCALING_PARAMETERS)}")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor: must be 1 (every head dimension rotated)")
    if rope_type == "default":
        return theta, None
    # As transformers: a top-level original_max_position_embeddings first, then the config's own.
    rope["original_max_position_embeddings"] = raw.get("original_max_position_embeddings",
                                                       rope.get("original_max_position_embeddings", max_positions))
    for param in ROPE_SCALING_PARAMETERS[rope_type]:
        value = rope.get(param)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}.{param}: {rope_type} rope scaling needs a positive number, got {value!r}")
    return theta, {"rope_type": rope_type, **{param: rope[param] for param in ROPE_SCALING_PARAMETERS[rope_type]}}


def _sliding_window(raw: dict) -> int | None:
    """Mistral's window covers every layer (null: none). Qwen's configs carry one that
    use_sliding_window turns on for some layers only, which the engine does not implement."""
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window: per-layer sliding windows are not supported")
    window = None if "use_sliding_window" in raw else raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window: must be a positive integer or null, got {window!r}")
    return window
