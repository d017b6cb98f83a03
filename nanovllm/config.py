"""The engine's configuration: `Config` holds every engine argument of nanovllm.LLM and the
model's ModelConfig (nanovllm.models.model_config)."""
import json
import os
from dataclasses import dataclass, field

import torch

from nanovllm.distributed import torchrun_env
from nanovllm.models import model_config, model_config_from_dir
from nanovllm.models.model_config import DTYPES, ModelConfig
from nanovllm.utils.gguf import gguf_model_config, is_gguf

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
    speculative_config: dict | None = None  # vLLM's keys: docs/speculative_decoding.md
    quantization: str | None = None  # "fp8": weights quantized to FP8 at load; FP8 checkpoints set it themselves
    weight_block_size: tuple[int, int] | None = field(init=False)  # of an FP8 checkpoint's weight scales
    hf_config: ModelConfig = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_kv_cache_dtype: torch.dtype = field(init=False)
    speculative: "SpeculativeConfig | None" = field(init=False)

    def __post_init__(self):
        if is_gguf(self.model):
            self.hf_config = model_config(gguf_model_config(self.model))
        elif os.path.isdir(self.model):
            self.hf_config = model_config_from_dir(self.model)
        else:
            raise ValueError(f"model: {self.model!r} is neither a checkpoint folder nor a .gguf file")
        self._check_ranges()
        self.weight_block_size = self._resolve_quantization()
        self.torch_device = resolve_device(self.device)
        self._check_parallel()
        self.torch_dtype = self._resolve_dtype()
        self.torch_kv_cache_dtype = KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.speculative = self._speculative()

    def _speculative(self) -> "SpeculativeConfig | None":
        if self.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.method == "draft_model":
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only")
            draft = model_config_from_dir(spec.model)
            if draft.vocab_size != self.hf_config.vocab_size:
                raise ValueError(f"speculative_config.model: its vocabulary ({draft.vocab_size} tokens) differs from "
                                 f"the target's ({self.hf_config.vocab_size})")
        return spec

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

    def _resolve_quantization(self) -> tuple[int, int] | None:
        """An FP8 checkpoint's block size (None: row scales computed at load, or no FP8)."""
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization: must be None or 'fp8', got {self.quantization!r}")
        stored = _checkpoint_quantization(self.model)
        if stored is None:
            return None
        method = stored.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method: {method!r} is not supported; supported: 'fp8'")
        for name, supported in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
            if stored.get(name, supported) != supported:
                raise ValueError(f"quantization_config.{name}: {stored[name]!r} is not supported; supported: {supported!r}")
        block = stored.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size: must be two positive integers, got {block!r}")
        if block is None:  # per-tensor scales: not a layout the FP8 layers hold
            raise ValueError("quantization_config.weight_block_size: FP8 checkpoints without block scales are not supported")
        self.quantization = "fp8"
        self._check_blocks(tuple(block))
        return tuple(block)

    def _check_blocks(self, block: tuple[int, int]) -> None:
        """Each rank's part of each projection, and each part of a merged one, holds whole
        blocks of the weight scales."""
        hf, tp = self.hf_config, self.tensor_parallel_size
        rows = {"q_proj": hf.num_attention_heads * hf.head_dim, "k_proj": hf.num_key_value_heads * hf.head_dim,
                "gate_proj": hf.intermediate_size}
        columns = {"o_proj": hf.num_attention_heads * hf.head_dim, "down_proj": hf.intermediate_size} if tp > 1 else {}
        for sizes, dim in ((rows, 0), (columns, 1)):
            for name, size in sizes.items():
                if size % tp or size // tp % block[dim]:
                    raise ValueError(f"quantization_config.weight_block_size: {name}'s {size} "
                                     f"{'output' if dim == 0 else 'input'} features split over "
                                     f"tensor_parallel_size {tp} do not fill whole blocks of {block[dim]}")

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


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """speculative_config, checked: "ngram" proposes the tokens that followed the most recent
    earlier occurrence of the sequence's last prompt_lookup_max..prompt_lookup_min tokens;
    "draft_model" proposes `model`'s greedy tokens. Up to num_speculative_tokens a step."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    @classmethod
    def from_dict(cls, values) -> "SpeculativeConfig":
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config: expected a dict, got {type(values).__name__}")
        method = values.get("method")
        keys = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
                "draft_model": {"method", "num_speculative_tokens", "model"}}
        if method not in keys:
            raise ValueError(f"speculative_config.method: must be 'ngram' or 'draft_model', got {method!r}")
        unknown = sorted(set(values) - keys[method])
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: not a setting of method {method!r}")
        k = _bounded_int(values, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, None)
        if method == "draft_model":
            model = values.get("model")
            if not isinstance(model, str) or not os.path.isdir(model):
                raise ValueError(f"speculative_config.model: {model!r} is not a directory")
            return cls(method, k, model=model)
        lookup_max = _bounded_int(values, "prompt_lookup_max", 1, MAX_PROMPT_LOOKUP, 4)
        lookup_min = _bounded_int(values, "prompt_lookup_min", 1, lookup_max, 1)
        return cls(method, k, lookup_min, lookup_max)


# Proposals past these gain nothing: acceptance falls with every further token.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64


def _bounded_int(values: dict, name: str, low: int, high: int, default: int | None) -> int:
    value = values.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _checkpoint_quantization(model: str) -> dict | None:
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):  # a GGUF file
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")


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
