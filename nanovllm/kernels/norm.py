"""Triton kernel for RMS normalisation over the last dimension, alone (rms_norm) or after a
residual add (fused_add_rms_norm). A program holds BLOCK_R whole rows in registers, so x is
read once and every output written once.

Rows are addressed as [outer, inner, D] through strides (see `_row_layout`): Qwen3's
per-head q/k norm runs on a [T, H, D] slice of the packed qkv output, whose token stride is
not H * D, without a copy."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import TILE_ELEMENTS, cdiv, next_power_of_2, num_warps, rows_per_program

RESIDUAL_TILE_ELEMENTS = TILE_ELEMENTS // 2


@triton.jit
def _row_offsets(rows, inner, outer_stride, inner_stride):
    # rows are int32 (a division by a run-time int64 is a long software routine, the largest
    # cost of a one-row call); inner == 1, the contiguous case, is specialised and folds away.
    return (rows // inner).to(tl.int64) * outer_stride + (rows % inner).to(tl.int64) * inner_stride


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, x_inner, x_outer_stride, x_inner_stride,
                     res_ptr, res_inner, res_outer_stride, res_inner_stride,
                     out_ptr, weight_ptr, n_rows, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out = rms_norm(x) into a contiguous out; with HAS_RESIDUAL, the sum x + res goes back
    into res and the normalised sum into x (out_ptr unused)."""
    await_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x_ptrs = x_ptr + _row_offsets(rows, x_inner, x_outer_stride, x_inner_stride)[:, None] + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    # Issued with x's load: after the row sum, whose cross-warp step ends in a barrier that no
    # load moves across, it would add a memory round trip to every program.
    weight = tl.load(weight_ptr + cols, mask=cols < D).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + _row_offsets(rows, res_inner, res_outer_stride, res_inner_stride)[:, None] + cols[None, :]
        summed = (x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        # normalise the sum as stored, as the unfused add-then-norm would
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = x * inv_rms[:, None] * weight[None, :]
    if HAS_RESIDUAL:
        tl.store(x_ptrs, normed.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(out_ptrs, normed.to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(x: torch.Tensor):
    """(x or a contiguous copy, inner, outer_stride, inner_stride): its rows as [outer, inner, D]
    with unit stride along D, read off x's strides where possible, since a view costs a
    microsecond of host time. Only leading dimensions whose strides do not merge into two
    are copied."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.is_contiguous():
        return x, 1, x.shape[-1], 0  # row r starts at r * D, whatever the dimensions
    strides = x.stride()
    if len(strides) == 2:
        return x, 1, strides[0], 0
    if len(strides) == 3:
        return x, x.shape[1], strides[0], strides[1]
    try:
        rows = x.view(-1, *x.shape[-2:])
    except RuntimeError:  # the leading strides do not merge
        x = x.contiguous()
        return x, 1, x.shape[-1], 0
    return x, rows.shape[1], rows.stride(0), rows.stride(1)


def _launch(x_layout, res_layout, out: torch.Tensor, weight: torch.Tensor, eps: float, has_residual: bool) -> None:
    d = out.shape[-1]
    n_rows = out.numel() // d
    block_d = next_power_of_2(d)
    # With a residual, half the shared tile and 64 values a thread on full grids: one warp for
    # two 1024-wide rows, two for a 4096-wide row (faster than the full tile:
    # docs/rejected.md).
    block_r = rows_per_program(n_rows, block_d, 1, RESIDUAL_TILE_ELEMENTS if has_residual else TILE_ELEMENTS)
    programs = cdiv(n_rows, block_r)
    _rms_norm_kernel[(programs,)](
        *x_layout, *res_layout, out, weight.contiguous(), n_rows, d, eps,
        HAS_RESIDUAL=has_residual, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=num_warps(block_r * block_d, programs, 64 if has_residual else 16),
        **dependent_launch(out.get_device()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Returns a new contiguous tensor; x is only read, through its strides."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() > 0:
        layout = _row_layout(x)
        _launch(layout, layout, out, weight, eps, has_residual=False)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """In place: the sum goes into residual's memory and the normalised sum into x's, and
    (x, residual) come back, so no memory is allocated. Inputs whose strides leave no
    [outer, inner, D] layout are copied first, and the copies come back instead."""
    if x.numel() == 0:
        return x, residual
    if residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        residual = residual.clone()  # else the sum and the normalised rows could land in one place
    x_layout, res_layout = _row_layout(x), _row_layout(residual)
    _launch(x_layout, res_layout, x_layout[0], weight, eps, has_residual=True)
    return x_layout[0], res_layout[0]
