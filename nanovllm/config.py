"""Engine and model configuration. `ModelConfig` reads a Hugging Face config.json as written
by transformers 4.x (rope_theta and rope_scaling, torch_dtype) or 5.x (rope_parameters, dtype)."""
import json
import os
from dataclasses import dataclass, field

import torch

from nanovllm.distributed import torchrun_env
from nanovllm.layers.rotary_embedding import ROPE_SCALING_PARAMETERS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Without a GPU the cache gets this many bytes unless num_kvcache_blocks says otherwise.
CPU_KV_CACHE_BYTES = 2 << 30
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

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Every check runs here, before a model is built or a weight read: an architecture
        outside the registry, a missing field, a rope scaling type or window the engine does
        not implement each raise a ValueError naming the field."""
        from nanovllm.models import MODEL_REGISTRY  # here: the model modules import this one
        architecture = (raw.get("architectures") or ["<none>"])[0]
        if architecture not in MODEL_REGISTRY:
            raise ValueError(f"model: architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(MODEL_REGISTRY)}")
        raw = {**MODEL_REGISTRY[architecture].hf_defaults, **raw}
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
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model: {model_dir!r} has no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


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


@dataclass(slots=True)
class Config:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    tensor_parallel_size: int = 1  # ranks one model is split across (docs/distributed.md)
    data_parallel_size: int = 1  # engine replicas, each of tensor_parallel_size ranks
    kvcache_block_size: int = 128
    num_kvcache_blocks: int = -1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    generation_config: str = "auto"  # "auto": sampling defaults from the checkpoint's generation_config.json
    hf_config: ModelConfig = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is not a directory")
        self.hf_config = ModelConfig.from_dir(self.model)
        self._check_ranges()
        self.torch_device = resolve_device(self.device)
        self._check_parallel()
        self.torch_dtype = self._resolve_dtype()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)

    def _check_ranges(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        size = self.kvcache_block_size
        if size < 1 or size & (size - 1):
            raise ValueError(f"kvcache_block_size: must be a power of two, got {size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format: must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config: must be 'auto' or 'none', got {self.generation_config!r}")

    def _check_parallel(self) -> None:
        """Heads and MLP features split evenly across ranks (none is replicated); each rank of
        each replica takes a GPU of its own."""
        tp, dp, hf = self.tensor_parallel_size, self.data_parallel_size, self.hf_config
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(hf, name) % tp:
                raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {name} ({getattr(hf, name)})")
        torchrun = tp > 1 and torchrun_env()
        if torchrun and (torchrun[1] != tp or dp > 1):
            raise ValueError(f"tensor_parallel_size: under torchrun it must equal WORLD_SIZE ({torchrun[1]}), "
                             f"with data_parallel_size 1; got {tp} and {dp}")
        if self.torch_device.type != "cuda" or tp * dp == 1:
            return
        if self.torch_device.index is not None:
            raise ValueError(f"device: {self.device!r} names one GPU, but rank r of each replica takes its own "
                             "(choose the GPUs with CUDA_VISIBLE_DEVICES)")
        needed = int(os.environ.get("LOCAL_WORLD_SIZE", tp)) if torchrun else tp * dp  # the ranks on this node
        if needed > torch.cuda.device_count():
            raise ValueError(f"{'data' if dp > 1 else 'tensor'}_parallel_size: {needed} ranks on this machine need a "
                             f"GPU each, {torch.cuda.device_count()} visible")

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # fp32 checkpoints run in bf16 on a GPU, as vLLM does; the CPU keeps the checkpoint's dtype.
            native = self.hf_config.torch_dtype
            return torch.bfloat16 if native == torch.float32 and self.torch_device.type == "cuda" else native
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {device!r} is not a device ({exc})") from None
    if resolved.type not in ("cuda", "cpu"):
        raise ValueError(f"device: only 'cuda' and 'cpu' are supported, got {device!r}")
    return resolved
