"""The sampler's warm-up at engine start (ModelRunner._warm_up_sampler): the requests that reach
every variant of the sampling kernels, and the threads their compiles overlap in."""
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nanovllm.sampling_params import SamplingParams

# Triton compiles an integer argument apart when it is 1 and when it is a multiple of 16:
# a row count of each kind.
SPECIALIZED_COUNTS = (1, 2, 16)
# Threads the warm-up compiles in: a compile holds the GIL for part of its time, so more
# threads add little, and each compile takes host memory of its own.
COMPILE_THREADS = 8


def warmup_params() -> list[SamplingParams]:
    """A request for each variant of the sampling kernels that a step can launch. A step's
    variant is its rows' together: whether any row ranks (top-k / top-p), and then the class
    of the largest top-k (kernels.sampling.max_top_k_variants); whether any has min-p; whether
    any asks for log-probabilities. One row of each combination thus reaches every step's
    variant. The first launches every kernel. Penalized rows are warmed for the sort-free
    classes that requests most use (no ranking, top-p, a top-k of 20); others compile on first use."""
    from nanovllm.kernels.sampling import max_top_k_variants  # Triton's: imported only where it serves
    rankings = [dict(top_k=k) for k in max_top_k_variants()] + [dict(top_p=0.5), {}]
    penalized = [dict(ranking, presence_penalty=0.5) for ranking in (dict(top_k=20), dict(top_p=0.5), {})]
    return [SamplingParams(seed=0, min_p=min_p, logprobs=logprobs, **ranking)
            for ranking in rankings + penalized for min_p in (0.5, 0.0) for logprobs in (1, None)]


def in_parallel(calls: list, device: torch.device) -> None:
    """Makes the calls: on CUDA in threads, on this thread's GPU (Triton's compiler leaves the
    GIL for much of its work, so compiles overlap); elsewhere one after another (no compiler
    runs, and Triton's interpreter is not thread-safe)."""
    if device.type != "cuda":
        for call in calls:
            call()
        return
    index = torch.cuda.current_device()

    def run(call):
        with torch.inference_mode(), torch.cuda.device(index):
            call()
    with ThreadPoolExecutor(min(COMPILE_THREADS, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(run, calls))  # raises the first failure
