"""One rank's KV cache: a block's bytes, how many blocks the cache takes (num_kvcache_blocks, a
CPU budget, or on a GPU what gpu_memory_utilization leaves after the largest step the scheduler
can produce), the tensor the attention layers write into, and a float8 cache's scales. The
cache is [2 (keys, values), layers, blocks, block_size, this rank's KV heads, head_dim]."""
import torch

from nanovllm import distributed
from nanovllm.config import CPU_KV_CACHE_BYTES, Config
from nanovllm.engine.worker import Workers, synchronize
from nanovllm.sampling_params import MAX_LOGPROBS
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import kv_cache_scales


def max_blocks_per_seq(config: Config) -> int:
    return -(-config.max_model_len // config.kvcache_block_size)


def num_kv_heads(config: Config) -> int:
    """Of one rank: its cache holds its share of the heads."""
    return config.hf_config.num_key_value_heads // config.tensor_parallel_size


def block_bytes(config: Config) -> int:
    hf = config.hf_config
    per_token = 2 * hf.num_hidden_layers * num_kv_heads(config) * hf.head_dim * config.torch_kv_cache_dtype.itemsize
    return per_token * config.kvcache_block_size


def set_scales(config: Config, attention_layers: list) -> None:
    """A float8 cache takes the checkpoint's per-tensor scales, where it has them (else 1.0)."""
    if config.torch_kv_cache_dtype.itemsize != 1 or config.load_format == "dummy":
        return
    for index, scales in kv_cache_scales(config.model).items():
        if index >= len(attention_layers):
            raise ValueError(f"model: checkpoint has KV scales of layer {index}, the model "
                             f"{len(attention_layers)} attention layers")
        layer = attention_layers[index]
        layer.k_scale, layer.v_scale = scales.get("k", 1.0), scales.get("v", 1.0)


def allocate(config: Config, attention_layers: list, num_blocks: int) -> torch.Tensor:
    """A zeroed cache of `num_blocks`, each attention layer bound to its keys' and values' part."""
    shape = (2, len(attention_layers), num_blocks, config.kvcache_block_size, num_kv_heads(config),
             config.hf_config.head_dim)
    cache = torch.zeros(shape, dtype=config.torch_kv_cache_dtype, device=config.torch_device)
    for i, layer in enumerate(attention_layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def count_blocks(config: Config, model, sampler, attention_layers: list, bytes_per_block: int,
                 workers: Workers | None) -> int:
    """The cache's block count, the same on every rank. `bytes_per_block`: a block's bytes
    here and in a draft model's cache, which takes as many blocks."""
    num_blocks, field = config.num_kvcache_blocks, "num_kvcache_blocks"
    device = config.torch_device
    if num_blocks <= 0 and device.type == "cuda":
        num_blocks = blocks_from_gpu_memory(config, model, sampler, attention_layers, bytes_per_block, workers)
        field = "gpu_memory_utilization"
    elif num_blocks <= 0:
        num_blocks = cpu_default_blocks(config, bytes_per_block)
    if config.tensor_parallel_size > 1:  # the scheduler's block ids must fit every rank's cache
        num_blocks = _min_across_ranks(num_blocks, device, workers)
    needed = max_blocks_per_seq(config)
    if num_blocks < needed:
        raise ValueError(f"{field}: leaves room for {max(num_blocks, 0)} KV blocks of {config.kvcache_block_size} "
                         f"tokens; one sequence of max_model_len={config.max_model_len} needs {needed}")
    return num_blocks


def cpu_default_blocks(config: Config, bytes_per_block: int) -> int:
    """A CPU_KV_CACHE_BYTES budget, but no more than max_num_seqs full-length sequences use."""
    needed = config.max_num_seqs * max_blocks_per_seq(config)
    return max(1, min(CPU_KV_CACHE_BYTES // bytes_per_block, needed))


def blocks_from_gpu_memory(config: Config, model, sampler, attention_layers: list, bytes_per_block: int,
                           workers: Workers | None) -> int:
    """Runs the largest step the scheduler can produce (with a temporary cache just large
    enough for it) and the sampling of a full decode batch, then gives the cache what is
    left of gpu_memory_utilization."""
    device = config.torch_device
    seq_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = -(-config.max_num_batched_tokens // seq_len)
    torch.cuda.empty_cache()
    cache = allocate(config, attention_layers, num_seqs * max_blocks_per_seq(config))
    # Weights and the temporary cache are in `base`; the peak above it is the activations.
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_step(config, model, sampler, num_seqs, seq_len)
    synchronize(workers)
    peak_activations = torch.cuda.max_memory_allocated(device) - base
    del cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights_and_others = total - free
    budget = total * config.gpu_memory_utilization - weights_and_others - peak_activations
    return int(budget // bytes_per_block)


@torch.inference_mode()
def run_largest_step(config: Config, model, sampler, num_seqs: int, seq_len: int) -> None:
    """A prefill of `num_seqs` sequences of `seq_len` tokens, then the draw of a full decode batch."""
    device, block_size = config.torch_device, config.kvcache_block_size
    tokens = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    tables = torch.arange(num_seqs * max_blocks_per_seq(config), dtype=torch.int32, device=device).view(num_seqs, -1)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    set_context(cu_seqlens_q=torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=device),
                seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
                block_tables=tables, max_seqlen_q=seq_len, slot_mapping=slots[:, :seq_len].flatten().long())
    hidden = model(tokens, positions)
    reset_context()
    # A full decode batch samples this many rows, with filters and every row asking for the
    # most log-probabilities: top_logprobs' log_softmax over the vocabulary is sampling's peak.
    rows = config.max_num_seqs
    logits = model.compute_logits(hidden[-1:].expand(rows, -1))
    if logits is not None:  # None on ranks other than 0, which do not sample
        ones = torch.ones(rows, device=device)
        sampler(logits, ones, torch.zeros(rows, dtype=torch.long, device=device),
                torch.full((rows,), 50, device=device), ones * 0.9, logprobs=True,
                top_rows=torch.arange(rows, device=device), num_top=MAX_LOGPROBS)


def _min_across_ranks(value: int, device: torch.device, workers: Workers | None) -> int:
    value = distributed.all_reduce(torch.tensor([value], device=device), op=torch.distributed.ReduceOp.MIN)
    if device.type == "cuda":  # rank 0 of several raises meanwhile if another rank fails
        synchronize(workers)
    return int(value.item())
