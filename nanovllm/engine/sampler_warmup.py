"""The sampler's warm-up at engine start (ModelRunner._warm_up_sampler): the requests that reach
every variant of the sampling kernels, their draws and the threads their compiles overlap in,
and a publish of each row count the publish kernel is compiled for."""
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nanovllm import kernels
from nanovllm.engine.sampling_inputs import SamplingInputs, TokenCounts
from nanovllm.engine.sequence import Sequence
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


def draw_every_variant(draw, vocab_size: int, noise_rng, device: torch.device) -> None:
    """Calls `draw(seqs, sampling)` on one sequence of each of warmup_params()."""
    counts = TokenCounts(vocab_size, device)  # the warm-up's own: its requests never finish
    draws = [functools.partial(draw, [seq], SamplingInputs([seq], vocab_size, noise_rng, counts))
             for seq in (Sequence(i, [0], params) for i, params in enumerate(warmup_params()))]
    draws[0]()  # alone: a kernel's first launch sets up its caches
    in_parallel(draws[1:], device)


def publish_every_count(buffers, max_rows: int, device: torch.device) -> None:
    """A kernels.publish_tokens into `buffers` (last_tokens, sampled_host, publish_parity) of
    each of SPECIALIZED_COUNTS up to `max_rows` rows."""
    last_tokens, sampled_host, publish_parity = buffers
    for count in SPECIALIZED_COUNTS:
        if count <= max_rows:
            kernels.publish_tokens(torch.zeros(count, dtype=torch.long, device=device), last_tokens, sampled_host,
                                   publish_parity)
    publish_parity.zero_()  # the host counts publishes from 0
