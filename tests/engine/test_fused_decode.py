"""The engine with the fused decode kernels (kernels.norm_linear, kernels.act_and_mul_linear)
serving its small batches, on CPU tensors through Triton's interpreter: the same greedy tokens
as transformers. On a GPU the same comparison is test_gpu_engine's fused-on against fused-off."""
import pytest

from test_kernel_backends import ENGINE, MAX_TOKENS, PROMPTS, checkpoint, hf_greedy  # noqa: F401  (fixture)

from nanovllm import LLM, SamplingParams, kernels


@pytest.mark.triton_interpret
def test_fused_decode_matches_transformers(checkpoint, monkeypatch):  # noqa: F811
    assert kernels.backend_for("cpu") == "triton", "the Triton path silently fell back to PyTorch"
    monkeypatch.setattr(kernels, "gemv_device_types", frozenset({"cpu"}))
    monkeypatch.setattr(kernels, "fused_decode_enabled", True)
    fused, implementation = [], kernels.implementation
    monkeypatch.setattr(kernels, "implementation",
                        lambda op, device: (fused.append(op) if op.endswith("_linear") else None)
                        or implementation(op, device))
    llm = LLM(str(checkpoint), **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert {"norm_linear", "act_and_mul_linear"} <= set(fused), "the fused decode kernels never ran"
    assert [o["token_ids"] for o in outs] == hf_greedy(checkpoint)
