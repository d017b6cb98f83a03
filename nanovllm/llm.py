from nanovllm.config import Config
from nanovllm.distributed import torchrun_env
from nanovllm.engine.data_parallel import DataParallelLLM
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.worker import serve_torchrun_rank


class LLM(LLMEngine):
    """Offline and online generation from a Hugging Face checkpoint folder of Qwen3, Qwen2, Llama,
    Mistral or Gemma (nanovllm.models.MODEL_REGISTRY), or a GGUF file of one (docs/quantization.md).

    LLM(model_dir, device="auto", dtype="auto", max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=4096, tensor_parallel_size=1, data_parallel_size=1, kvcache_block_size=128,
        num_kvcache_blocks=-1, gpu_memory_utilization=0.9, enable_prefix_caching=True,
        enforce_eager=False, load_format="auto", generation_config="auto", kv_cache_dtype="auto",
        speculative_config=None, quantization=None)

    device "auto" takes CUDA when present, else the CPU. dtype "auto" keeps the checkpoint's
    dtype (fp32 checkpoints run in bf16 on a GPU). The KV cache takes gpu_memory_utilization of
    the GPU after a warm-up step that measures peak activation memory; on the CPU it takes
    num_kvcache_blocks blocks, or by default 2 GiB (nanovllm.config.CPU_KV_CACHE_BYTES), never
    more than max_num_seqs full-length sequences need. load_format="dummy" fills the weights
    with random values from config.json alone. kv_cache_dtype="fp8" (or "fp8_e4m3") stores the
    KV cache as float8 e4m3 with the checkpoint's per-layer k_scale/v_scale, else 1.0
    (docs/attention.md#fp8-kv-cache); "auto" keeps the model's dtype. quantization="fp8" holds
    the projections' weights in FP8, quantized at load; FP8 checkpoints load as FP8 without it.

    Length: prompt + output <= max_model_len. A prompt of max_model_len tokens or more leaves
    no room for output and is rejected (ValueError naming `prompt`); a shorter one ends with
    finish_reason "length" when its output reaches max_tokens or the whole sequence reaches
    max_model_len, whichever comes first.

    speculative_config: speculative decoding, as vLLM takes it: {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": M} or
    {"method": "draft_model", "model": DRAFT_DIR, "num_speculative_tokens": k}
    (docs/speculative_decoding.md).

    Prompts: a string, a list of token ids, or a 1-D integer numpy array or torch tensor is one
    prompt. generate() also takes a non-empty list of prompts, or a 2-D integer array or tensor
    (one prompt per row); anything else is a ValueError naming `prompts`.

    Sampling: temperature 0, and any temperature below 1e-5
    (nanovllm.sampling_params.GREEDY_TEMPERATURE), takes the most likely token. A request
    without SamplingParams gets SamplingParams(**llm.sampling_defaults): with
    generation_config="auto", the temperature, top_k, top_p and min_p set in the checkpoint's
    generation_config.json (top_k 0 there means no top-k); with "none", SamplingParams()'s own
    defaults. An explicit SamplingParams is taken as given. EOS ids are read from
    generation_config.json either way.

    Online: add_request() queues a prompt, step() runs the engine and returns an output per
    request that received a token (request_id, token_ids so far, new_token_id, finished,
    finish_reason, text once finished, and logprobs: the new token's {token id:
    log-probability} when its SamplingParams ask, else None). Each step() queues the next step on the device before
    reading the tokens of the one before, so one step is in flight between calls; abort() works
    between steps (a token still in flight for the aborted request is dropped). Online requests
    keep running inside generate(); the outputs they produce there come from the next step(),
    in order.

    tensor_parallel_size N splits the model across N GPUs (worker processes, started with
    spawn: scripts need an `if __name__ == "__main__":` guard); data_parallel_size M > 1 returns
    a DataParallelLLM of M such engines, which offers generate(). Under torchrun, LLM() on ranks
    other than 0 serves rank 0 until it closes, then exits the process. close(), a `with` block
    or the interpreter's exit stops the worker processes (docs/distributed.md)."""

    def __new__(cls, model: str, **engine_args):
        if engine_args.get("data_parallel_size", 1) != 1:
            return DataParallelLLM(model, **engine_args)
        torchrun = torchrun_env()
        if torchrun and torchrun[0] > 0 and engine_args.get("tensor_parallel_size", 1) > 1:
            serve_torchrun_rank(ModelRunner, Config(model, **engine_args))
            raise SystemExit(0)
        return super().__new__(cls)

    def close(self) -> None:
        """Stops the tensor-parallel ranks, leaves their group and frees the engine's device
        memory (weights, KV cache, CUDA graphs), so that another engine can start in this
        process; a step still in flight is dropped. Later steps raise; closing again does
        nothing."""
        self._in_flight.clear()
        self.model_runner.close()
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
