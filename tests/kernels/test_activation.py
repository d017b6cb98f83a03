import pytest
import torch
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, poison_allocator, randn, require_triton,
                            strided_rows, upcast)

from nanovllm.kernels import element_wise_mul_add, fused_add_gelu, gelu_and_mul, reference, silu_and_mul

GATED = {
    "silu": (silu_and_mul, reference.silu_and_mul),
    "gelu_tanh": (lambda x: gelu_and_mul(x, "tanh"), lambda x: reference.gelu_and_mul(x, "tanh")),
    "gelu_none": (lambda x: gelu_and_mul(x, "none"), lambda x: reference.gelu_and_mul(x, "none")),
}


def _layouts(rows: int, width: int, dtype, device):
    """The same logical [rows, width] input as a plain tensor, a slice of a wider buffer, extra
    leading dimensions, and a transpose (whose rows cannot be merged without a copy)."""
    return {
        "contiguous": randn(rows, width, dtype=dtype, device=device),
        "row_slice": strided_rows(rows, width, dtype, device),
        "leading_dims": randn(2, rows, width, dtype=dtype, device=device),
        "transposed": randn(width, 3, rows, dtype=dtype, device=device).permute(2, 1, 0)[:, 1],
    }


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("activation", sorted(GATED))
@pytest.mark.parametrize("rows,d", [(1, 200), (5, 1024), (3, 4095)])
def test_gated_matches_float64(device, dtype, activation, rows, d):
    require_triton(device)
    fused, ref = GATED[activation]
    for layout, x in _layouts(rows, 2 * d, dtype, device).items():
        poison_allocator(x.numel() * x.element_size() // 2, device)
        out = fused(x)
        assert out.is_contiguous(), layout
        assert_close(out, ref(*upcast(x)), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("rows,width", [(1, 200), (5, 1024), (3, 4095)])
def test_fused_add_gelu_matches_float64(device, dtype, approximate, rows, width):
    require_triton(device)
    bias = randn(width, dtype=dtype, device=device)
    for x in _layouts(rows, width, dtype, device).values():
        poison_allocator(x.numel() * x.element_size(), device)
        assert_close(fused_add_gelu(x, bias, approximate), reference.fused_add_gelu(*upcast(x, bias), approximate), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("rows,width", [(1, 200), (5, 1024), (3, 4095)])
def test_element_wise_mul_add_matches_float64(device, dtype, rows, width):
    """All contiguous takes the flat path; any strided operand the row path."""
    require_triton(device)
    layouts = _layouts(rows, width, dtype, device)
    contiguous = [randn(rows, width, dtype=dtype, device=device) for _ in range(3)]
    mixed = [layouts["row_slice"], contiguous[0], layouts["transposed"]]
    for a, b, c in (contiguous, mixed):
        poison_allocator(a.numel() * a.element_size(), device)
        assert_close(element_wise_mul_add(a, b, c), reference.element_wise_mul_add(*upcast(a, b, c)), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_many_rows_share_a_program(device, dtype):
    """Enough rows that a program takes several, with a ragged last tile."""
    require_triton(device)
    x = randn(601, 2 * 100, dtype=dtype, device=device)
    assert_close(silu_and_mul(x), reference.silu_and_mul(*upcast(x)), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_empty_input(device, dtype):
    require_triton(device)
    assert silu_and_mul(torch.empty(0, 64, dtype=dtype, device=device)).shape == (0, 32)
    assert fused_add_gelu(torch.empty(0, 8, dtype=dtype, device=device),
                          torch.zeros(8, dtype=dtype, device=device)).shape == (0, 8)


@pytest.mark.gpu
def test_cuda_graph_capture():
    x = randn(64, 2 * 3072, dtype=torch.bfloat16, device="cuda")
    bias = randn(2 * 3072, dtype=torch.bfloat16, device="cuda")
    assert_close(capture_and_replay(lambda: silu_and_mul(x)), reference.silu_and_mul(x.double()), torch.bfloat16)
    assert_close(capture_and_replay(lambda: fused_add_gelu(x, bias)),
                 reference.fused_add_gelu(x.double(), bias.double()), torch.bfloat16)
    assert_close(capture_and_replay(lambda: element_wise_mul_add(x, x, bias.expand_as(x))),
                 reference.element_wise_mul_add(x.double(), x.double(), bias.double().expand_as(x)), torch.bfloat16)


@pytest.mark.parametrize("call,name", [
    (lambda: silu_and_mul(torch.randn(3, 7)), "x"),
    (lambda: gelu_and_mul(torch.randn(3, 8), approximate="erf"), "approximate"),
    (lambda: silu_and_mul(torch.arange(8)), "x"),
    (lambda: fused_add_gelu(torch.randn(3, 8), torch.randn(7)), "bias"),
    (lambda: fused_add_gelu(torch.randn(3, 8), torch.randn(8, dtype=torch.float16)), "bias"),
    (lambda: element_wise_mul_add(torch.randn(3, 8), torch.randn(3, 7), torch.randn(3, 8)), "b"),
    (lambda: element_wise_mul_add(torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float16)), "c"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()
