"""Engine and model configuration. `ModelConfig` reads a Hugging Face config.json as written
by transformers 4.x (rope_theta, torch_dtype) or 5.x (rope_parameters, dtype)."""
import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Without a GPU the cache gets this many bytes unless num_kvcache_blocks says otherwise.
CPU_KV_CACHE_BYTES = 2 << 30


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype
    eos_token_id: list[int]

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        architecture = (raw.get("architectures") or ["<none>"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model: architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = raw.get("rope_parameters") or {}
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
            hidden_act=raw.get("hidden_act", "silu"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Qwen3 has them only when attention_bias says so.
            attention_bias=architecture == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            qk_norm=architecture == "Qwen3ForCausalLM",
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


@dataclass(slots=True)
class Config:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
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
        self.torch_dtype = self._resolve_dtype()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)

    def _check_ranges(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
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
