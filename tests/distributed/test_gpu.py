"""Tensor and data parallelism on two GPUs (NCCL, CUDA graphs with the all-reduces inside):
fp32 greedy tokens equal one GPU's and transformers'; a rank killed mid-generation makes the
call raise and close() leaves no process."""
import pytest
import torch

from parallel_testing import call_with_timeout, child_pids, engine
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.engine.worker import WorkerError
from test_failures import KilledRank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
PROMPTS = [[5, 17, 3, 99, 42] * 9, [200, 201], [33] * 300, list(range(40, 140))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# A fixed cache: sizing from free memory would count the other test processes' allocations.
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, kvcache_block_size=16, max_num_batched_tokens=128,
              num_kvcache_blocks=256)


def tokens(llm) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        hf = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    with LLM(str(checkpoint), **ENGINE) as llm:
        assert tokens(llm) == hf
    return hf


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tp2_equals_one_gpu_and_transformers(checkpoint, expected, enforce_eager):
    with engine(model=str(checkpoint), tensor_parallel_size=2, **{**ENGINE, "enforce_eager": enforce_eager}) as llm:
        assert bool(llm.model_runner.graphs) != enforce_eager
        assert tokens(llm) == expected
    assert not child_pids()


def test_dp2_equals_one_gpu(checkpoint, expected):
    with engine(model=str(checkpoint), data_parallel_size=2, **ENGINE) as llm:
        assert tokens(llm) == expected
    assert not child_pids()


def test_killed_rank_raises_and_leaves_nothing(checkpoint, monkeypatch):
    monkeypatch.setattr(llm_engine, "ModelRunner", KilledRank)
    llm = engine(model=str(checkpoint), tensor_parallel_size=2, **ENGINE)
    error = call_with_timeout(llm.generate, PROMPTS, PARAMS, False, timeout=60)
    assert isinstance(error, WorkerError) and "exited with code -9" in str(error)
    call_with_timeout(llm.close, timeout=30)
    assert not child_pids()
