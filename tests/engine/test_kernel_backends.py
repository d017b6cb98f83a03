"""The engine gives the same greedy tokens whichever kernel backend runs: the Triton kernels
(through Triton's interpreter on the CPU) and the forced PyTorch fallback both match
transformers' greedy generate."""
import json
import os
import subprocess
import sys

import pytest
import torch

from checkpoints import build_checkpoint

from nanovllm import LLM, SamplingParams, kernels

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [200, 201], [33] * 40]
MAX_TOKENS = 6
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=24,
              max_num_batched_tokens=32)  # 32 forces a chunked prefill of the 40-token prompt

ENGINE_SCRIPT = """
import json, sys
from nanovllm import LLM, SamplingParams, kernels
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"backend": kernels.backend_for("cpu"), "tokens": [o["token_ids"] for o in outs]}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("backends"), arch="qwen3", tied=True)


def hf_greedy(checkpoint) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def engine_in_subprocess(checkpoint, backend: str) -> dict:
    env = {**os.environ, "NANOVLLM_KERNEL_BACKEND": backend}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(checkpoint), json.dumps(ENGINE),
                             json.dumps(PROMPTS), str(MAX_TOKENS)], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_forced_torch_backend_matches_transformers(checkpoint):
    result = engine_in_subprocess(checkpoint, "torch")
    assert result["backend"] == "torch"
    assert result["tokens"] == hf_greedy(checkpoint)


@pytest.mark.triton_interpret
def test_triton_kernels_match_transformers_and_the_fallback(checkpoint):
    assert kernels.backend_for("cpu") == "triton", "the Triton path silently fell back to PyTorch"
    llm = LLM(str(checkpoint), **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    triton_tokens = [o["token_ids"] for o in outs]
    assert triton_tokens == hf_greedy(checkpoint)
    assert triton_tokens == engine_in_subprocess(checkpoint, "torch")["tokens"]
