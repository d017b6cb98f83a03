"""Parallel engines one after another in one process: close() of a tensor-parallel engine drops
rank 0's tensors and ends the other ranks' processes, closing twice is fine, and data-parallel
replicas then start, then a single-process engine. On two GPUs, with every engine sized from
free memory (gpu_memory_utilization), each GPU's free memory comes back after close()."""
import gc
import weakref

import pytest
import torch

from parallel_testing import ENGINE, call_with_timeout, child_pids, engine
from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 99, 42] * 4, [200, 201, 7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def rank0_tensor_refs(llm) -> list[weakref.ref]:
    runner = llm.model_runner
    return [weakref.ref(t) for t in (*runner.model.parameters(), runner.kv_cache, runner.last_tokens)]


def test_tp2_close_frees_rank0_and_ends_its_ranks_then_dp2_then_tp1(checkpoint):
    expected = tokens(LLM(str(checkpoint), **ENGINE))
    llm = engine(model=str(checkpoint), tensor_parallel_size=2, **ENGINE)
    assert tokens(llm) == expected
    refs, processes = rank0_tensor_refs(llm), llm.model_runner.workers.processes
    gc.collect()
    gc.disable()  # freed by reference counts alone
    try:
        assert call_with_timeout(llm.close) is None
        assert not any(ref() is not None for ref in refs), "close() left rank 0's tensors referenced"
    finally:
        gc.enable()
    assert all(process.exitcode == 0 for process in processes) and not child_pids()
    llm.close()
    with engine(model=str(checkpoint), data_parallel_size=2, **ENGINE) as replicas:
        assert tokens(replicas) == expected
    replicas.close()
    assert not child_pids()
    with LLM(str(checkpoint), **ENGINE) as single:
        assert tokens(single) == expected


# ---- on two GPUs ----
# The CUDA context, cuBLAS's workspaces, the compiled kernels and rank 0's NCCL state (about
# 0.5 GB on an H200 once its group is destroyed) stay with the process.
MEMORY_MARGIN = 1 << 30
GPU_ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, kvcache_block_size=16,
                  max_num_batched_tokens=128, gpu_memory_utilization=0.5)


def free_memory(device: int) -> int:
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_then_dp2_then_one_gpu_each_sized_from_free_memory(checkpoint):
    """Before the fix, the tensor-parallel engine's rank 0 kept its cache after close(), and
    the data-parallel replica on its GPU found room for 0 KV blocks."""
    with LLM(str(checkpoint), **GPU_ENGINE) as single:  # also compiles the kernels, which stay loaded
        expected = tokens(single)
    before = [free_memory(0), free_memory(1)]  # with the CUDA contexts this process keeps
    llm = engine(model=str(checkpoint), tensor_parallel_size=2, **GPU_ENGINE)
    assert tokens(llm) == expected
    assert call_with_timeout(llm.close, timeout=60) is None
    assert not child_pids()
    for device in (0, 1):
        assert free_memory(device) >= before[device] - MEMORY_MARGIN, f"GPU {device} did not get its memory back"
    with engine(model=str(checkpoint), data_parallel_size=2, **GPU_ENGINE) as replicas:
        assert tokens(replicas) == expected
    assert not child_pids()
    with LLM(str(checkpoint), **GPU_ENGINE) as single:
        assert tokens(single) == expected
    assert free_memory(0) >= before[0] - MEMORY_MARGIN
