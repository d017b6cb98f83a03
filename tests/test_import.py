import subprocess
import sys


def test_importing_nanovllm_does_not_initialise_cuda():
    code = ("import torch, nanovllm, nanovllm.kernels, nanovllm.integrations; "
            "from nanovllm import LLM, SamplingParams; "
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
