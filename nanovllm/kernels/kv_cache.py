"""Triton kernel that scatters new keys and values into the paged caches.

Work is split into head rows: row r is head r % Hk of token r // Hk, copied to
cache[slot // block_size, slot % block_size, r % Hk, :] for slot = slot_mapping[r // Hk].
Every operand is addressed through its strides, so key and value may be slices of the packed
qkv output. Cache offsets are int64: a cache may hold more than 2^31 elements. A float8 cache
stores each value times 1 / its tensor's scale, saturated (to_cache)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2, num_warps, rows_per_program


FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value; it has no infinity


def inverse_scale(scale: float) -> float:
    """What a store multiplies by, in fp32 (the reference's to_cache rounds alike)."""
    return 1.0 / scale


@triton.jit
def to_cache(x, inv_scale, cache_ty: tl.constexpr):
    """x as a cache of element type `cache_ty` stores it: into a float8 cache, x * inv_scale
    in fp32, saturated (the conversion alone would give NaN past the largest value)."""
    if cache_ty.is_fp8():
        return tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX).to(cache_ty)
    return x.to(cache_ty)


@triton.jit
def _copy_rows(src_ptr, src_token_stride, src_head_stride, src_dim_stride,
               dst_ptr, dst_block_stride, dst_offset_stride, dst_head_stride, dst_dim_stride,
               tokens, heads, blocks, offsets, cols, mask, inv_scale):
    src = src_ptr + (tokens * src_token_stride + heads * src_head_stride)[:, None] + cols[None, :] * src_dim_stride
    dst_rows = blocks * dst_block_stride + offsets * dst_offset_stride + heads * dst_head_stride
    values = tl.load(src, mask=mask)
    tl.store(dst_ptr + dst_rows[:, None] + cols[None, :] * dst_dim_stride,
             to_cache(values, inv_scale, dst_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _store_kvcache_kernel(key_ptr, key_token_stride, key_head_stride, key_dim_stride,
                          value_ptr, value_token_stride, value_head_stride, value_dim_stride,
                          k_cache_ptr, k_block_stride, k_offset_stride, k_head_stride, k_dim_stride,
                          v_cache_ptr, v_block_stride, v_offset_stride, v_head_stride, v_dim_stride,
                          slot_mapping_ptr, n_rows, kv_heads, head_dim, block_size, k_inv_scale, v_inv_scale,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    # Divisions in int32 (int64's is a long software routine), products in int64.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    tokens, heads = (rows // kv_heads).to(tl.int64), (rows % kv_heads).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + tokens, mask=rows < n_rows, other=-1).to(tl.int32)
    mask = ((rows < n_rows) & (slots >= 0))[:, None] & (cols < head_dim)[None, :]
    blocks, offsets = (slots // block_size).to(tl.int64), (slots % block_size).to(tl.int64)
    _copy_rows(key_ptr, key_token_stride, key_head_stride, key_dim_stride,
               k_cache_ptr, k_block_stride, k_offset_stride, k_head_stride, k_dim_stride,
               tokens, heads, blocks, offsets, cols, mask, k_inv_scale)
    _copy_rows(value_ptr, value_token_stride, value_head_stride, value_dim_stride,
               v_cache_ptr, v_block_stride, v_offset_stride, v_head_stride, v_dim_stride,
               tokens, heads, blocks, offsets, cols, mask, v_inv_scale)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    n_tokens, kv_heads, head_dim = key.shape
    n_rows = n_tokens * kv_heads
    if n_rows == 0 or head_dim == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_r = rows_per_program(n_rows, block_d)
    programs = cdiv(n_rows, block_r)
    _store_kvcache_kernel[(programs,)](
        key, *key.stride(), value, *value.stride(), k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
        slot_mapping, n_rows, kv_heads, head_dim, k_cache.shape[1], inverse_scale(k_scale), inverse_scale(v_scale),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps(block_r * block_d, programs),
        **dependent_launch(key.get_device()))
