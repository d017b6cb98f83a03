"""The GEMV's prologues (nanovllm/kernels/gemv.py): norm_linear (residual add and RMS norm
before the projection) and act_and_mul_linear (SiLU/GELU of the gate times up before it),
against the float64 reference on both GEMV paths, and the boundary's choice between them and
the separate kernels. Tolerances: kernel_testing.TOLERANCE."""
import pytest
import torch
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, poison_allocator,
                            randn, require_triton, strided_rows, upcast)

from nanovllm import kernels
from nanovllm.kernels import reference

# (rows, features N, input K, with a bias): split-K and unsplit launches, K not a multiple of
# the norm prologue's step, one row and the most the GEMV takes.
SHAPES = [(1, 77, 300, True), (5, 130, 1000, False), (16, 600, 40, True), (3, 65, 2500, False)]
EPS = 1e-5


def _gemv():
    from nanovllm.kernels import gemv  # imports Triton: only where the tests need it
    return gemv


def _check_norm_linear(x, residual, norm_weight, weight, bias, dtype):
    before = [t.clone() for t in (x, residual) if t is not None]
    poison_allocator(64 * weight.shape[0] * 4 + x.numel() * 8, x.device.type)
    out, summed = _gemv().norm_linear(x, residual, norm_weight, EPS, weight, bias)
    expected, expected_sum = reference.norm_linear(
        *upcast(x), None if residual is None else residual.double(), norm_weight.double(), EPS, weight.double(),
        None if bias is None else bias.double())
    assert_close(out, expected, dtype)
    assert_close(summed, expected_sum, dtype)
    if residual is None:
        assert summed is x
    for t, kept in zip((x, residual), before):
        assert torch.equal(t, kept), "an input was overwritten"


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("rows,n,k,with_bias", SHAPES)
def test_norm_linear_matches_float64(device, dtype, rows, n, k, with_bias):
    require_triton(device)
    x, residual = randn(rows, k, dtype=dtype, device=device), randn(rows, k, dtype=dtype, device=device)
    norm_weight, weight = randn(k, dtype=dtype, device=device), randn(n, k, dtype=dtype, device=device)
    bias = randn(n, dtype=dtype, device=device) if with_bias else None
    _check_norm_linear(x, residual, norm_weight, weight, bias, dtype)
    _check_norm_linear(x, None, norm_weight, weight, bias, dtype)  # a decoder's first layer


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_norm_linear_strided_operands(device, dtype):
    """x and residual as rows of wider buffers (different strides), with leading dimensions,
    and transposed (copied); a strided norm weight."""
    require_triton(device)
    n, k = 130, 300
    weight, norm_weight = randn(n, k, dtype=dtype, device=device), randn(k, 2, dtype=dtype, device=device)[:, 0]
    _check_norm_linear(strided_rows(3, k, dtype, device), randn(3, k + 1, dtype=dtype, device=device)[:, 1:],
                       norm_weight, weight, None, dtype)
    _check_norm_linear(randn(2, 3, k, dtype=dtype, device=device), randn(2, 3, k, dtype=dtype, device=device),
                       norm_weight, weight, None, dtype)
    _check_norm_linear(randn(k, 4, dtype=dtype, device=device).t(), randn(4, k, dtype=dtype, device=device),
                       norm_weight, weight, None, dtype)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows,n,k,with_bias", SHAPES[:2])
def test_act_and_mul_linear_matches_float64(device, dtype, activation, rows, n, k, with_bias):
    require_triton(device)
    weight = randn(n, k, dtype=dtype, device=device)
    bias = randn(n, dtype=dtype, device=device) if with_bias else None
    for gate_up in (randn(rows, 2 * k, dtype=dtype, device=device), strided_rows(rows, 2 * k, dtype, device)):
        poison_allocator(64 * n * 4, device)
        out = _gemv().act_and_mul_linear(gate_up, weight, bias, activation)
        expected = reference.act_and_mul_linear(*upcast(gate_up, weight), None if bias is None else bias.double(),
                                                activation)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_every_k_block_its_own_split_and_counters_left_at_zero(device, dtype):
    """The most partials per reduction, twice in a row, with each prologue: the counters must
    be back at 0 and the residual written by its one program."""
    require_triton(device)
    gemv = _gemv()
    rows, n, k = 7, 150, 1000
    config = gemv.config_for(n, k, torch.tensor([], dtype=dtype).element_size(),
                             torch.cuda.current_device() if device == "cuda" else -1, programs_per_sm=4096)
    assert config.splits == -(-k // config.block_k) > 2
    x, residual = randn(rows, k, dtype=dtype, device=device), randn(rows, k, dtype=dtype, device=device)
    norm_weight, weight = randn(k, dtype=dtype, device=device), randn(n, k, dtype=dtype, device=device)
    gate_up = randn(rows, 2 * k, dtype=dtype, device=device)
    expected, expected_sum = reference.norm_linear(*upcast(x, residual, norm_weight), EPS, weight.double())
    expected_gated = reference.act_and_mul_linear(*upcast(gate_up, weight))
    for _ in range(2):
        poison_allocator(rows * n * 4 * (config.splits + 2) + rows * k * 4, device)
        out, summed = torch.empty(rows, n, dtype=dtype, device=device), torch.empty_like(x)
        gemv.launch(x, weight, None, out, config, norm_weight=norm_weight, eps=EPS, residual=residual,
                    residual_out=summed)
        assert_close(out, expected, dtype)
        assert_close(summed, expected_sum, dtype)
        out = torch.empty(rows, n, dtype=dtype, device=device)
        gemv.launch(gate_up, weight, None, out, config, activation="silu")
        assert_close(out, expected_gated, dtype)
    assert not gemv._arrival_counters(torch.device(device)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_qwen3_shapes_in_bf16(rows):
    """Qwen3-0.6B's qkv and gate_up after the norm, its down projection after SiLU."""
    dtype = torch.bfloat16
    for n, k in ((4096, 1024), (6144, 1024)):
        x, residual = randn(rows, k, dtype=dtype, device="cuda"), randn(rows, k, dtype=dtype, device="cuda")
        weight = randn(n, k, dtype=dtype, device="cuda") * k ** -0.5
        _check_norm_linear(x, residual, 1 + 0.1 * randn(k, dtype=dtype, device="cuda"), weight, None, dtype)
    gate_up, weight = randn(rows, 6144, dtype=dtype, device="cuda"), randn(1024, 3072, dtype=dtype, device="cuda")
    assert_close(_gemv().act_and_mul_linear(gate_up, weight), reference.act_and_mul_linear(*upcast(gate_up, weight)),
                 dtype)


@pytest.mark.gpu
def test_cuda_graph_capture():
    x, residual = randn(2, 1024, dtype=torch.bfloat16, device="cuda"), randn(2, 1024, dtype=torch.bfloat16, device="cuda")
    norm_weight, weight = randn(1024, dtype=torch.bfloat16, device="cuda"), randn(4096, 1024, dtype=torch.bfloat16,
                                                                                 device="cuda")
    expected, expected_sum = reference.norm_linear(*upcast(x, residual, norm_weight), EPS, weight.double())
    out, summed = capture_and_replay(lambda: _gemv().norm_linear(x, residual, norm_weight, EPS, weight))
    assert_close(out, expected, torch.bfloat16)
    assert_close(summed, expected_sum, torch.bfloat16)
    assert not _gemv()._arrival_counters(torch.device("cuda")).any()


def _fused_on_cpu(monkeypatch):
    """The boundary's fused routing on CPU tensors (the reference serves them outside the interpreter)."""
    monkeypatch.setattr(kernels, "gemv_enabled", True)
    monkeypatch.setattr(kernels, "fused_decode_enabled", True)
    monkeypatch.setattr(kernels, "gemv_device_types", frozenset({"cpu"}))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows", [3, 17])
def test_boundary_routes_small_batches_to_the_fusions(monkeypatch, fused, rows):
    """At most GEMV_MAX_ROWS rows with the fusions on: one fused op each; otherwise the
    separate norm or activation and linear (the GEMV, or F.linear past GEMV_MAX_ROWS). Every
    route gives the reference's result."""
    x, residual, norm_weight, weight = torch.randn(rows, 24), torch.randn(rows, 24), torch.randn(24), torch.randn(5, 24)
    gate_up = torch.randn(rows, 48)
    expected, expected_sum = reference.norm_linear(x, residual, norm_weight, EPS, weight)
    expected_gated = reference.act_and_mul_linear(gate_up, weight)
    _fused_on_cpu(monkeypatch)
    monkeypatch.setattr(kernels, "fused_decode_enabled", fused)
    ops, implementation = [], kernels.implementation
    monkeypatch.setattr(kernels, "implementation", lambda op, device: ops.append(op) or implementation(op, device))
    out, summed = kernels.norm_linear(x.clone(), residual.clone(), norm_weight, EPS, weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(summed, expected_sum)
    torch.testing.assert_close(kernels.act_and_mul_linear(gate_up, weight), expected_gated)
    if fused and rows <= kernels.GEMV_MAX_ROWS:
        assert ops == ["norm_linear", "act_and_mul_linear"]
    elif rows <= kernels.GEMV_MAX_ROWS:
        assert ops == ["fused_add_rms_norm", "small_batch_linear", "silu_and_mul", "small_batch_linear"]
    else:
        assert ops == ["fused_add_rms_norm", "silu_and_mul"]


@pytest.mark.parametrize("call,name", [
    (lambda: kernels.norm_linear(torch.randn(2, 8), torch.randn(2, 7), torch.randn(8), EPS, torch.randn(3, 8)),
     "residual"),
    (lambda: kernels.norm_linear(torch.randn(2, 8), None, torch.randn(7), EPS, torch.randn(3, 8)), "norm_weight"),
    (lambda: kernels.norm_linear(torch.randn(2, 8), None, torch.randn(8), EPS, torch.randn(3, 7)), "weight"),
    (lambda: kernels.norm_linear(torch.randn(2, 8), None, torch.randn(8), EPS, torch.randn(3, 8), torch.randn(4)),
     "bias"),
    (lambda: kernels.act_and_mul_linear(torch.randn(2, 7), torch.randn(3, 4)), "x"),
    (lambda: kernels.act_and_mul_linear(torch.randn(2, 8), torch.randn(3, 8)), "weight"),
    (lambda: kernels.act_and_mul_linear(torch.randn(2, 8), torch.randn(3, 4), activation="relu"), "activation"),
])
def test_bad_arguments_name_the_argument(monkeypatch, call, name):
    _fused_on_cpu(monkeypatch)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()
