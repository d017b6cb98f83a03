import pytest
import torch
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, poison_allocator,
                            randn, require_triton, strided_rows, upcast)

from nanovllm.kernels import fused_add_rms_norm, reference, rms_norm

EPS = 1e-6


def _check_rms_norm(x, weight, dtype):
    before = x.clone()
    poison_allocator(x.numel() * x.element_size(), x.device.type)
    out = rms_norm(x, weight, EPS)
    assert torch.equal(x, before), "rms_norm must not write its input"
    assert out.shape == x.shape and out.is_contiguous()
    assert_close(out, reference.rms_norm(*upcast(x, weight), EPS), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("shape", [(1, 200), (7, 4095), (2, 3, 1024)])
def test_rms_norm_matches_float64(device, dtype, shape):
    require_triton(device)
    _check_rms_norm(randn(*shape, dtype=dtype, device=device), randn(shape[-1], dtype=dtype, device=device), dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_per_head_norm_of_a_packed_qkv_slice(device, dtype):
    """Qwen3's q/k norm: [T, H, D] heads inside the qkv output, token stride (Hq + 2 Hk) * D."""
    require_triton(device)
    tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 128
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.view(tokens, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=1)
    weight = randn(head_dim, dtype=dtype, device=device)
    _check_rms_norm(q, weight, dtype)
    _check_rms_norm(k, weight, dtype)
    _check_rms_norm(qkv.view(1, tokens, -1, head_dim)[:, :, q_heads:q_heads + kv_heads], weight, dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_rms_norm_of_unmergeable_and_transposed_views(device, dtype):
    require_triton(device)
    weight = randn(64, dtype=dtype, device=device)
    _check_rms_norm(randn(3, 4, 5, 64, dtype=dtype, device=device)[:, 1:3, 1:4], weight, dtype)
    _check_rms_norm(randn(64, 6, dtype=dtype, device=device).t(), weight, dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_many_rows_share_a_program(device, dtype):
    require_triton(device)
    _check_rms_norm(randn(601, 96, dtype=dtype, device=device), randn(96, dtype=dtype, device=device), dtype)


def _check_fused(x, residual, weight, dtype):
    expected_normed, expected_sum = reference.fused_add_rms_norm(*upcast(x, residual, weight), EPS)
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    assert_close(summed, expected_sum, dtype)
    assert_close(normed, expected_normed, dtype)
    return normed, summed


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("shape", [(1, 200), (7, 4095), (2, 3, 1024)])
def test_fused_add_rms_norm_matches_float64_in_place(device, dtype, shape):
    """Documented contract: the normalised sum comes back in x's memory, the sum in residual's."""
    require_triton(device)
    x, residual = randn(*shape, dtype=dtype, device=device), randn(*shape, dtype=dtype, device=device)
    normed, summed = _check_fused(x, residual, randn(shape[-1], dtype=dtype, device=device), dtype)
    assert normed.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_fused_add_rms_norm_of_views(device, dtype):
    require_triton(device)
    weight = randn(1024, dtype=dtype, device=device)
    buffer = randn(5, 1024 + 32, dtype=dtype, device=device)
    untouched = buffer[:, 1024:].clone()
    x, residual = buffer[:, :1024], randn(5, 1024, dtype=dtype, device=device)
    normed, _ = _check_fused(x, residual, weight, dtype)
    assert normed.data_ptr() == x.data_ptr()
    assert torch.equal(buffer[:, 1024:], untouched), "columns outside the view must stay"
    _check_fused(strided_rows(5, 1024, dtype, device), randn(1024, 5, dtype=dtype, device=device).t(), weight, dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_fused_add_rms_norm_with_x_as_its_own_residual(device, dtype):
    require_triton(device)
    x = randn(3, 256, dtype=dtype, device=device)
    expected_normed, expected_sum = reference.fused_add_rms_norm(*upcast(x, x), torch.ones(256, dtype=torch.float64,
                                                                                           device=device), EPS)
    normed, summed = fused_add_rms_norm(x, x, torch.ones(256, dtype=dtype, device=device), EPS)
    assert_close(summed, expected_sum, dtype)
    assert_close(normed, expected_normed, dtype)


# Gemma's norm scale 1 + w, held in fp32 by the model whatever x's dtype.
FP32_WEIGHT_TARGETS = [
    pytest.param("cpu", torch.bfloat16, id="reference-bfloat16"),
    pytest.param("cpu", torch.float16, id="reference-float16"),
    TARGETS[1],  # interpreter, bf16
    *(pytest.param("cuda", dtype, marks=pytest.mark.gpu, id=f"cuda-{str(dtype)[6:]}")
      for dtype in (torch.bfloat16, torch.float16)),
]


@pytest.mark.parametrize("device,dtype", FP32_WEIGHT_TARGETS)
def test_float32_weight_with_half_precision_x(device, dtype):
    """Output in x's dtype, computed in fp32 from the fp32 weight (reference or kernel, as
    dispatch serves)."""
    weight = 1 + 0.01 * randn(1000, dtype=torch.float32, device=device)
    _check_rms_norm(randn(7, 1000, dtype=dtype, device=device), weight, dtype)
    _check_rms_norm(strided_rows(5, 1000, dtype, device), weight, dtype)
    _check_fused(randn(7, 1000, dtype=dtype, device=device), randn(7, 1000, dtype=dtype, device=device), weight, dtype)


@pytest.mark.gpu
def test_cuda_graph_capture():
    x = randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    weight = randn(1024, dtype=torch.bfloat16, device="cuda")
    assert_close(capture_and_replay(lambda: rms_norm(x, weight, EPS)),
                 reference.rms_norm(x.double(), weight.double(), EPS), torch.bfloat16)
    residual = randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    xs, residuals = x.clone(), residual.clone()
    expected_normed, expected_sum = reference.fused_add_rms_norm(x.double(), residual.double(), weight.double(), EPS)
    # replayed once after capture: the warm-up and the capture run consume their own copies
    normed, summed = capture_and_replay(lambda: fused_add_rms_norm(xs.copy_(x), residuals.copy_(residual), weight, EPS))
    assert_close(summed, expected_sum, torch.bfloat16)
    assert_close(normed, expected_normed, torch.bfloat16)


_BASE = torch.randn(4, 5, 6, 7, 8)


@pytest.mark.parametrize("x", [
    _BASE[0, 0, 0], _BASE[0, 0], _BASE[0], _BASE, _BASE[:, 1:3], _BASE[:, :, 2:5], _BASE[:, 1:3, 2:5], _BASE[::2],
    _BASE[:, :1], _BASE[:1, :, :1], _BASE[..., 1:5], _BASE.transpose(0, 1), _BASE.transpose(2, 3),
    _BASE[0].transpose(0, 1), _BASE.view(20, 6, 7, 8)[:, 1:4],
], ids=lambda x: f"{tuple(x.shape)}:{x.stride()}")
def test_row_layout_addresses_every_row(x):
    """The kernel's addressing, (r // inner) * outer_stride + (r % inner) * inner_stride, applied
    to the layout of x (no interpreter needed): it must find x's rows in order."""
    from nanovllm.kernels.norm import _row_layout
    t, inner, outer_stride, inner_stride = _row_layout(x)
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    starts = [t.storage_offset() + (r // inner) * outer_stride + (r % inner) * inner_stride
              for r in range(x.numel() // x.shape[-1])]
    assert torch.equal(torch.stack([flat[start:start + x.shape[-1]] for start in starts]), x.reshape(-1, x.shape[-1]))
    assert t.data_ptr() == x.data_ptr() or t.is_contiguous()  # a view where one serves, else a copy


@pytest.mark.parametrize("call,name", [
    (lambda: rms_norm(torch.randn(3, 8), torch.randn(7), EPS), "weight"),
    (lambda: rms_norm(torch.randn(3, 8), torch.randn(8, dtype=torch.float16), EPS), "weight"),
    (lambda: rms_norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.float16), EPS), "weight"),
    (lambda: fused_add_rms_norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16),
                                torch.randn(8, dtype=torch.float64), EPS), "weight"),
    (lambda: rms_norm(torch.arange(8), torch.randn(8), EPS), "x"),
    (lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.randn(8), EPS), "residual"),
    (lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float16), torch.randn(8), EPS),
     "residual"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()
