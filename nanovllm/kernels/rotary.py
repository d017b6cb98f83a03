"""Triton kernel for neox-style rotary embedding, applied in place to q and k in one launch.

Work is split into head rows: row r of a [T, H, D] tensor is head r % H of token r // H.
A program rotates BLOCK_R head rows of either q or k, reading and writing them through
their strides, so q and k may be slices of the packed qkv projection output."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2, num_warps, rows_per_program


@triton.jit
def _rotate_rows(x_ptr, first_row, n_rows, heads, token_stride, head_stride, dim_stride,
                 positions_ptr, cache_ptr, cache_stride, half,
                 BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    rows = first_row + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    tokens = (rows // heads).to(tl.int64)
    # the same token's cos/sin row is gathered once per head; the repeats hit L1
    position = tl.load(positions_ptr + tokens, mask=rows < n_rows, other=0).to(tl.int64)
    cos_ptrs = cache_ptr + position[:, None] * cache_stride + cols[None, :]
    cos = tl.load(cos_ptrs, mask=mask).to(tl.float32)
    sin = tl.load(cos_ptrs + half, mask=mask).to(tl.float32)
    head_rows = tokens * token_stride + (rows % heads).to(tl.int64) * head_stride
    x1_ptrs = x_ptr + head_rows[:, None] + cols[None, :] * dim_stride
    x2_ptrs = x1_ptrs + half * dim_stride
    x1 = tl.load(x1_ptrs, mask=mask).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask).to(tl.float32)
    tl.store(x1_ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x2_ptrs, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_tokens"])
def _rotary_kernel(q_ptr, q_heads, q_token_stride, q_head_stride, q_dim_stride,
                   k_ptr, k_heads, k_token_stride, k_head_stride, k_dim_stride,
                   positions_ptr, cache_ptr, cache_stride, n_tokens, half,
                   BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, q_programs) take q's head rows, the rest k's."""
    await_previous_kernel(PDL)
    pid = tl.program_id(0)
    # Head-row indices in int32 (fewer than 2^31 rows): a division by a run-time int64 is a
    # long software routine.
    q_rows = n_tokens * q_heads
    q_programs = tl.cdiv(q_rows, BLOCK_R)
    if pid < q_programs:
        _rotate_rows(q_ptr, pid * BLOCK_R, q_rows, q_heads, q_token_stride, q_head_stride,
                     q_dim_stride, positions_ptr, cache_ptr, cache_stride, half, BLOCK_R, BLOCK_HALF)
    else:
        _rotate_rows(k_ptr, (pid - q_programs) * BLOCK_R, n_tokens * k_heads,
                     k_heads, k_token_stride, k_head_stride, k_dim_stride,
                     positions_ptr, cache_ptr, cache_stride, half, BLOCK_R, BLOCK_HALF)


def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotates q and k in place, through their strides, and returns them."""
    n_tokens, half = q.shape[0], q.shape[2] // 2
    if n_tokens == 0 or half == 0:
        return q, k
    block_half = next_power_of_2(half)
    block_r = rows_per_program(n_tokens * (q.shape[1] + k.shape[1]), 2 * block_half)
    grid = (cdiv(n_tokens * q.shape[1], block_r) + cdiv(n_tokens * k.shape[1], block_r),)
    cache = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    positions = positions if positions.stride(0) == 1 else positions.contiguous()  # the kernel reads it densely
    _rotary_kernel[grid](q, q.shape[1], *q.stride(), k, k.shape[1], *k.stride(),
                         positions, cache, cache.stride(0), n_tokens, half,
                         BLOCK_R=block_r, BLOCK_HALF=block_half,
                         num_warps=num_warps(2 * block_r * block_half, grid[0]), **dependent_launch(q.get_device()))
    return q, k
