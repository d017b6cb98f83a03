"""An FP8 checkpoint with block scales split over two CPU processes (gloo): each rank loads its
rows (column-parallel) or columns (row-parallel) of every weight and of its block scales, and
the greedy tokens equal transformers' on the dequantized float32 copy."""
import pytest

from checkpoints import build_checkpoint
from fp8_checkpoints import write_fp8_checkpoint
from parallel_testing import ENGINE, call_with_timeout
from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 3], [200, 11, 64, 8]]
MAX_TOKENS = 12


def test_fp8_checkpoint_on_two_ranks_matches_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    src = build_checkpoint(tmp_path / "src", arch="qwen3", tied=True)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "dequantized", (16, 16))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **ENGINE) as llm:
        outs = call_with_timeout(llm.generate, PROMPTS, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == expected


def test_blocks_split_by_the_ranks_are_refused(tmp_path):
    src = build_checkpoint(tmp_path / "src", arch="qwen3", tied=True)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "dequantized", (32, 16))
    with pytest.raises(ValueError, match="k_proj's 32 output features split over tensor_parallel_size 2 "
                                         "do not fill whole blocks of 32"):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **ENGINE)
