"""An engine's end: close() (or a `with` block) drops every tensor of the engine, so another
engine can start in the same process; closing twice is fine, and later steps raise. An
engine dropped without close() is freed at once, with no reference cycle waiting for the
garbage collector. On a GPU, the free memory comes back to what it was before the engine."""
import contextlib
import gc
import weakref

import pytest
import torch

from checkpoints import build_checkpoint
from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 99, 42] * 4, [200, 201, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONLINE = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)


def tokens(llm) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def tensor_refs(llm) -> list[weakref.ref]:
    """Weak references to the engine's tensors: weights, KV cache, sampling buffers."""
    runner = llm.model_runner
    tensors = [*runner.model.parameters(), *runner.model.buffers(), runner.kv_cache, runner.last_tokens,
               runner.sampled_host, runner.publish_parity]
    return [weakref.ref(t) for t in tensors]


def alive(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


@contextlib.contextmanager
def no_garbage_collector():
    """What is freed here is freed by reference counts alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_close_drops_every_tensor_and_a_second_engine_starts(checkpoint, new_llm):
    path = checkpoint("qwen3_tied")
    llm = new_llm(path)
    expected = tokens(llm)
    llm.add_request(PROMPTS[0], ONLINE)
    llm.step()  # a step stays in flight between step() calls
    refs = tensor_refs(llm)
    with no_garbage_collector():
        llm.close()
        assert alive(refs) == 0, "close() left tensors of the engine referenced"
    llm.close()  # closing again does nothing
    with pytest.raises(RuntimeError, match="closed"):
        tokens(llm)
    with pytest.raises(RuntimeError, match="closed"):
        llm.memory_stats()
    with new_llm(path) as second:
        assert tokens(second) == expected


def test_engine_dropped_without_close_is_freed_at_once(checkpoint, new_llm):
    llm = new_llm(checkpoint("qwen3_tied"))
    tokens(llm)
    llm.add_request(PROMPTS[1], ONLINE)
    llm.step()
    refs = tensor_refs(llm) + [weakref.ref(llm.model_runner), weakref.ref(llm)]
    with no_garbage_collector():
        del llm
        assert alive(refs) == 0, "a reference cycle keeps the engine until the garbage collector runs"


# ---- on a GPU ----
# The CUDA context, cuBLAS's workspaces and the compiled kernels stay with the process.
MEMORY_MARGIN = 256 << 20
GPU_ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=512, kvcache_block_size=16,
                  max_num_batched_tokens=128, gpu_memory_utilization=0.5)


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gpu_close"), arch="qwen3", tied=True)


def free_gpu_memory() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_close_gives_the_gpu_memory_back(gpu_checkpoint, enforce_eager):
    """Engines sized from free memory (gpu_memory_utilization): the first takes half the GPU;
    after close(), the free memory is back to within MEMORY_MARGIN of before, and a second
    engine gets as large a cache and the same tokens. An engine dropped without close() frees
    its memory as soon as it is dropped."""
    engine = dict(GPU_ENGINE, enforce_eager=enforce_eager)
    torch.zeros(1, device="cuda")  # the CUDA context, which stays, before the first measure
    before = free_gpu_memory()
    with LLM(str(gpu_checkpoint), **engine) as llm:
        blocks = llm.model_runner.num_kvcache_blocks
        expected = tokens(llm)
        assert free_gpu_memory() < before - torch.cuda.mem_get_info()[1] // 4
    llm.close()
    assert free_gpu_memory() >= before - MEMORY_MARGIN
    second = LLM(str(gpu_checkpoint), **engine)
    assert second.model_runner.num_kvcache_blocks >= 0.95 * blocks
    assert tokens(second) == expected
    with no_garbage_collector():
        del second
        assert free_gpu_memory() >= before - MEMORY_MARGIN
