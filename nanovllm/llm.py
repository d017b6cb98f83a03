from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """Offline and online generation from a Hugging Face Qwen3/Qwen2 checkpoint folder.

    LLM(model_dir, device="auto", dtype="auto", max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=4096, kvcache_block_size=128, num_kvcache_blocks=-1, gpu_memory_utilization=0.9,
        enable_prefix_caching=True, enforce_eager=False, load_format="auto")

    device "auto" takes CUDA when present, else the CPU. dtype "auto" keeps the checkpoint's
    dtype (fp32 checkpoints run in bf16 on a GPU). The KV cache takes gpu_memory_utilization of
    the GPU after a warm-up step that measures peak activation memory; on the CPU it takes
    num_kvcache_blocks blocks, or by default 2 GiB (nanovllm.config.CPU_KV_CACHE_BYTES), never
    more than max_num_seqs full-length sequences need. load_format="dummy" fills the weights
    with random values from config.json alone."""
