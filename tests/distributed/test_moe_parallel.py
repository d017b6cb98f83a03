"""Mixture-of-experts models split over two CPU processes (tensor_parallel_size=2, gloo): each
rank holds every expert's slice of the intermediate dimension (and of the shared expert's),
one all-reduce a layer; greedy tokens equal one process's and transformers' in fp32."""
import pytest

from checkpoints import FAMILY_CHECKPOINTS, build_checkpoint
from engine.conftest import GreedyReference
from parallel_testing import ENGINE, child_pids, engine
from nanovllm import SamplingParams

PROMPTS = [list(range(2, 40)), [7, 300, 12, 5]]
MAX_TOKENS = 12


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_tp2_tokens_equal_tp1_and_transformers(name, tmp_path):
    path = build_checkpoint(tmp_path / name, **FAMILY_CHECKPOINTS[name])
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for size in (1, 2):
        with engine(model=str(path), tensor_parallel_size=size, **ENGINE) as llm:
            tokens[size] = [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    reference = GreedyReference(path)
    expected = [reference(p, MAX_TOKENS) for p in PROMPTS]
    assert tokens[2] == tokens[1] == expected
    assert not child_pids()
