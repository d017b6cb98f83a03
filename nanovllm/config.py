"""The engine's configuration: `Config` holds every engine argument of nanovllm.LLM and the
model's ModelConfig (nanovllm.models.model_config)."""
import os
from dataclasses import dataclass, field

import torch

from nanovllm.distributed import torchrun_env
from nanovllm.models import model_config_from_dir
from nanovllm.models.model_config import DTYPES, ModelConfig

# Without a GPU the cache gets this many bytes unless num_kvcache_blocks says otherwise.
CPU_KV_CACHE_BYTES = 2 << 30
# kv_cache_dtype -> the cache's element type; "auto" takes the model's dtype.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}

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
    kv_cache_dtype: str = "auto"  # "fp8" (e4m3, docs/attention.md#fp8-kv-cache) or "auto": the model's dtype
    hf_config: ModelConfig = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_kv_cache_dtype: torch.dtype = field(init=False)

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is not a directory")
        self.hf_config = model_config_from_dir(self.model)
        self._check_ranges()
        self.torch_device = resolve_device(self.device)
        self._check_parallel()
        self.torch_dtype = self._resolve_dtype()
        self.torch_kv_cache_dtype = KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)
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
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

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
