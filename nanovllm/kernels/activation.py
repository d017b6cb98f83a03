"""Triton kernels for the elementwise ops: silu/gelu of one half times the other half
(silu_and_mul, gelu_and_mul), gelu(x + bias) and a * b + c.

Every kernel walks a 2-D [rows, cols] view whose columns are contiguous, in tiles of
BLOCK_R rows x BLOCK_C columns on a 1-D grid. The views come from `_rows`, which copies only
when no such view exists (a transposed input, or leading dimensions whose strides do not
merge). Outputs are new contiguous tensors."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2, num_warps, rows_per_program

_MAX_BLOCK_C = 1024  # divides the real hidden sizes (1024..8192, 3072) without a ragged tail
# Half the shared rule's tile: three sweeps found it faster for silu_and_mul and
# fused_add_gelu at 256 and 4096 rows (docs/rejected.md).
_TILE_ELEMENTS = 2048


@triton.jit
def _tile(pid, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row indices (int64), column indices and the in-bounds mask of program `pid`'s tile."""
    col_blocks = tl.cdiv(n_cols, BLOCK_C)
    rows = tl.cast(pid // col_blocks, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    # int64 columns: element_wise_mul_add flattens whole tensors into one row
    cols = tl.cast(pid % col_blocks, tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, mask


# gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u) = x / (1 + 2^(x (A + B x^2))), with
# u = sqrt(2/pi) (x + 0.044715 x^3) and the constants below; no cancellation for x << 0.
_GELU_TANH_A = tl.constexpr(-2 * 0.7978845608028654 * 1.4426950408889634)
_GELU_TANH_B = tl.constexpr(-2 * 0.7978845608028654 * 0.044715 * 1.4426950408889634)


@triton.jit
def _gelu(x, APPROXIMATE: tl.constexpr):
    if APPROXIMATE == "tanh":
        # One exp2 and one division: 6 instructions an element fewer than the sigmoid form
        # (sm_90 SASS of fused_add_gelu, 328 rather than 424 for a thread's 16 elements). At
        # H200 bandwidth its arithmetic takes as long as its memory traffic, so the shorter
        # form is faster (docs/rejected.md).
        return x / (1.0 + tl.exp2(x * (_GELU_TANH_A + _GELU_TANH_B * x * x)))
    else:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def activate(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return x * tl.sigmoid(x)
    else:
        return _gelu(x, ACTIVATION)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _act_and_mul_kernel(x_ptr, out_ptr, n_rows, d, x_row_stride,
                        ACTIVATION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    rows, cols, mask = _tile(tl.program_id(0), n_rows, d, BLOCK_R, BLOCK_C)
    gate_ptrs = x_ptr + rows[:, None] * x_row_stride + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask).to(tl.float32)
    out = activate(gate, ACTIVATION) * up
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _add_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_rows, n_cols, x_row_stride,
                     APPROXIMATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_R, BLOCK_C)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    out = _gelu(x + bias[None, :], APPROXIMATE)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n_rows, n_cols, a_row_stride, b_row_stride, c_row_stride,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    rows, cols, mask = _tile(tl.program_id(0), n_rows, n_cols, BLOCK_R, BLOCK_C)
    a = tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * b_row_stride + cols[None, :], mask=mask).to(tl.float32)
    c = tl.load(c_ptr + rows[:, None] * c_row_stride + cols[None, :], mask=mask).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (a * b + c).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, x.shape[-1]] with unit column stride: a view where the strides allow one."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x  # the common case, without the microsecond a reshape costs
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(kernel, n_rows: int, n_cols: int, *args, per_thread: int = 8, **constexprs) -> None:
    """Runs `kernel` over a [n_rows, n_cols] problem in tiles of BLOCK_R rows x BLOCK_C columns,
    `per_thread` values a thread on full grids. 8 (one 16-byte vector: 8 warps for a
    2048-element tile): three sweeps agreed on it for silu_and_mul and element_wise_mul_add at
    4096 rows; fused_add_gelu's favoured 4 warps (docs/rejected.md)."""
    block_c = min(next_power_of_2(n_cols), _MAX_BLOCK_C)
    col_blocks = cdiv(n_cols, block_c)
    block_r = rows_per_program(n_rows, block_c, col_blocks, _TILE_ELEMENTS)
    grid = (cdiv(n_rows, block_r) * col_blocks,)
    kernel[grid](*args, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps(block_r * block_c, grid[0], per_thread),
                 **dependent_launch(args[0].get_device()), **constexprs)


def _act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = _rows(x)
    _launch(_act_and_mul_kernel, rows.shape[0], d, rows, out, rows.shape[0], d, rows.stride(0), ACTIVATION=activation)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return _act_and_mul(x, approximate)


def fused_add_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    rows, n_cols = _rows(x), x.shape[-1]
    _launch(_add_gelu_kernel, rows.shape[0], n_cols, rows, bias.contiguous(), out, rows.shape[0], n_cols,
            rows.stride(0), per_thread=16, APPROXIMATE=approximate)
    return out


def element_wise_mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if a.is_contiguous() and b.is_contiguous() and c.is_contiguous():
        # one long row, full tiles whatever the last dimension is; its row stride is never used
        n_rows, n_cols, views, strides = 1, out.numel(), (a, b, c), (0, 0, 0)
    else:
        views = [_rows(t) for t in (a, b, c)]
        (n_rows, n_cols), strides = views[0].shape, [v.stride(0) for v in views]
    _launch(_mul_add_kernel, n_rows, n_cols, *views, out, n_rows, n_cols, *strides)
    return out
