"""kernels.fp8_linear: per-token FP8 activations times an FP8 weight with row or block scales,
against the float64 computation of the same quantized operands (kernels/fp8.py), through the
Triton GEMM (interpreter and GPU) and, on the GPU, torch._scaled_mm for many rows; the
activation quantization against float64's."""
import pytest
import torch

from kernel_testing import TARGETS, assert_close, require_triton
from nanovllm import kernels
from nanovllm.kernels import reference



def _check(rows, n, k, block, dtype, device, bias=True):
    from nanovllm.kernels.fp8 import fp8_gemm_float64, quantize_rows, quantize_rows_float64
    torch.manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, dtype=dtype, device=device)
    weight, scale = reference.quantize_fp8(torch.randn(n, k, device=device) * 0.05, block)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    out = kernels.fp8_linear(x, weight, scale, block, b)
    xq, x_scale = quantize_rows(x)
    expected_q, expected_scale = quantize_rows_float64(x)
    torch.testing.assert_close(x_scale.double(), expected_scale, rtol=1e-6, atol=0)
    # A value near an e4m3 rounding midpoint may land on either side in fp32: one step (an
    # eighth of its magnitude at most, 2^-9 among the subnormals) apart, and rarely.
    step = (expected_q.float() - xq.float()).abs()
    assert (step <= expected_q.float().abs() / 8 + 2 ** -9).all()
    assert (step > 0).float().mean() < 0.05
    assert_close(out, fp8_gemm_float64(xq, x_scale, weight, scale, block, b), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("block", [None, (16, 32)], ids=["rows", "blocks"])
@pytest.mark.parametrize("rows", [1, 19])
def test_fp8_linear_matches_float64(device, dtype, block, rows):
    require_triton(device)
    _check(rows, 48, 80, block, dtype, device, bias=rows == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["rows", "blocks"])
@pytest.mark.parametrize("rows", [1, 4, 100, 512])
def test_fp8_linear_model_shapes_on_gpu(block, rows):
    """Qwen3-8B's o_proj shape: decode rows on the Triton GEMM, prefill rows on _scaled_mm
    (row scales) or the Triton GEMM (block scales)."""
    _check(rows, 4096, 4096, block, torch.bfloat16, "cuda")


def test_reference_dequantizes_the_weight():
    x = torch.randn(3, 40)
    weight, scale = reference.quantize_fp8(torch.randn(24, 40), (16, 16))
    assert scale.shape == (2, 3)
    expected = x @ reference.dequantize_fp8(weight, scale, (16, 16)).T
    torch.testing.assert_close(reference.fp8_linear(x, weight, scale, (16, 16)), expected)
