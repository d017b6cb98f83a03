"""Triton kernel for everything between the qkv projection and attention, in one launch:
Qwen3's per-head RMS norm of q and k (optional), neox-style rotary embedding of both, and
the scatter of k and v into the paged caches. Unfused that is four launches a layer (q norm,
k norm, rotary, KV store), each a few microseconds at decode sizes.

A token tile's work is split into parts of at most as many heads as k has: Q_PARTS parts
rewrite the q heads in place, the next writes the rotated k heads to the key cache and the
last copies the v heads to the value cache. Parts of about one size keep the programs about
equally long, and the part is the fastest-moving program index, so that a tile's programs
run together and read its rows of the packed qkv output at once (docs/rejected.md). Tiles
are [tokens, heads, half a head]: a head row is loaded as two halves, the pairs the rotation
mixes."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_cache import inverse_scale, to_cache
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2, num_warps, rows_per_program

# k elements a program takes on large batches: 2 tokens of Qwen3-0.6B (8 kv heads of 128)
_TOKEN_TILE_ELEMENTS = 2048


@triton.jit
def _head_rows(ptr, token_offsets, token_mask, head_stride, heads, half, BLOCK_H: tl.constexpr,
               BLOCK_HALF: tl.constexpr):
    """[tokens, heads, first half] pointers of a tile whose tokens start at `token_offsets`
    (int64), and its mask; the second halves are `half` on."""
    head = tl.arange(0, BLOCK_H)[None, :, None]
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = token_mask[:, None, None] & (head < heads) & (cols < half)
    first = ptr + token_offsets[:, None, None] + head * head_stride + cols
    return first, first + half, mask


@triton.jit
def norm_rope(x1, x2, weight_ptr, cos, sin, half, eps, cols, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """Halves of head rows along the last axis, of any rank; `cols` indexes that axis."""
    if HAS_NORM:
        # weights before the sums: a load placed after a reduction waits for it (see norm.py)
        w1 = tl.load(weight_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, -1, keep_dims=True) + tl.sum(x2 * x2, -1, keep_dims=True)) / (2 * half)
                           + eps)
        # rounded to the activation dtype, as the unfused norm's output is before rotary reads it
        x1 = (x1 * inv_rms * w1).to(dtype).to(tl.float32)
        x2 = (x2 * inv_rms * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@fast_launch
@triton.jit(do_not_specialize=["n_tokens", "eps"])
def _qk_norm_rope_store_kernel(
    q_ptr, q_token_stride, q_head_stride, k_ptr, k_token_stride, k_head_stride,
    v_ptr, v_token_stride, v_head_stride, positions_ptr, cos_sin_ptr, cos_sin_stride,
    q_weight_ptr, k_weight_ptr, eps, slot_mapping_ptr, k_cache_ptr, kc_block_stride, kc_offset_stride, kc_head_stride,
    v_cache_ptr, vc_block_stride, vc_offset_stride, vc_head_stride, k_inv_scale, v_inv_scale, n_tokens, q_heads,
    kv_heads, half, block_size, q_part_heads, HAS_NORM: tl.constexpr, Q_PARTS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    await_previous_kernel(PDL)
    part = tl.program_id(0) % (Q_PARTS + 2)
    tokens = tl.program_id(0) // (Q_PARTS + 2) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < n_tokens
    # Each part in its own branch and functions: q and k tiles may differ in shape, and values
    # defined in one branch of an `if` must match those of the other.
    if part < Q_PARTS:
        first_head = part * q_part_heads
        q1, q2, mask = _head_rows(q_ptr + first_head * q_head_stride, tokens.to(tl.int64) * q_token_stride, in_range,
                                  q_head_stride, tl.minimum(q_part_heads, q_heads - first_head), half, BLOCK_HQ,
                                  BLOCK_HALF)
        r1, r2 = _rotated(q1, q2, mask, tokens, in_range, positions_ptr, cos_sin_ptr, cos_sin_stride, q_weight_ptr,
                          eps, half, HAS_NORM, BLOCK_HALF)
        tl.store(q1, r1, mask=mask)
        tl.store(q2, r2, mask=mask)
    else:
        # -1: a padding token that owns no slot, so nothing is written for it. Its k and v are
        # read all the same: loads masked by the slot would wait for it (measured slower:
        # docs/rejected.md).
        slots = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1).to(tl.int32)
        if part == Q_PARTS:
            k1, k2, mask = _head_rows(k_ptr, tokens.to(tl.int64) * k_token_stride, in_range, k_head_stride, kv_heads,
                                      half, BLOCK_HK, BLOCK_HALF)
            r1, r2 = _rotated(k1, k2, mask, tokens, in_range, positions_ptr, cos_sin_ptr, cos_sin_stride,
                              k_weight_ptr, eps, half, HAS_NORM, BLOCK_HALF)
            _store_in_cache(k_cache_ptr, r1, r2, k_inv_scale, slots, block_size, kc_block_stride, kc_offset_stride,
                            kc_head_stride, kv_heads, half, BLOCK_HK, BLOCK_HALF)
        else:
            v1, v2, mask = _head_rows(v_ptr, tokens.to(tl.int64) * v_token_stride, in_range, v_head_stride, kv_heads,
                                      half, BLOCK_HK, BLOCK_HALF)
            _store_in_cache(v_cache_ptr, tl.load(v1, mask=mask), tl.load(v2, mask=mask), v_inv_scale, slots,
                            block_size, vc_block_stride, vc_offset_stride, vc_head_stride, kv_heads, half, BLOCK_HK,
                            BLOCK_HALF)


@triton.jit
def _rotated(x1_ptrs, x2_ptrs, mask, tokens, in_range, positions_ptr, cos_sin_ptr, cos_sin_stride, weight_ptr, eps,
             half, HAS_NORM: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The normalised (HAS_NORM) and rotated halves of a [tokens, heads, half] tile, in x's dtype."""
    cols = tl.arange(0, BLOCK_HALF)
    positions = tl.load(positions_ptr + tokens, mask=in_range, other=0).to(tl.int64)
    cos_ptrs = cos_sin_ptr + positions[:, None, None] * cos_sin_stride + cols[None, None, :]
    cos = tl.load(cos_ptrs, mask=cols[None, None, :] < half).to(tl.float32)
    sin = tl.load(cos_ptrs + half, mask=cols[None, None, :] < half).to(tl.float32)
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    dtype = x1_ptrs.dtype.element_ty
    r1, r2 = norm_rope(x1, x2, weight_ptr, cos, sin, half, eps, cols, HAS_NORM, dtype)
    # through x's dtype first: the unfused path stores the rotated tensor, then copies k to the cache
    return r1.to(dtype), r2.to(dtype)


@triton.jit
def _store_in_cache(cache_ptr, x1, x2, inv_scale, slots, block_size, block_stride, offset_stride, head_stride, heads,
                    half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # int32 division (int64's is a long routine), int64 products: block * block_stride
    # exceeds 2^31 elements in large caches
    base = (slots // block_size).to(tl.int64) * block_stride + (slots % block_size).to(tl.int64) * offset_stride
    first, second, mask = _head_rows(cache_ptr, base, slots >= 0, head_stride, heads, half, BLOCK_H, BLOCK_HALF)
    tl.store(first, to_cache(x1, inv_scale, cache_ptr.dtype.element_ty), mask=mask)
    tl.store(second, to_cache(x2, inv_scale, cache_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight=None, k_weight=None, eps: float = 1e-6, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    n_tokens, q_heads, head_dim = q.shape
    if n_tokens == 0:
        return q
    kv_heads, half = k.shape[1], head_dim // 2
    # Rows are addressed as token * token_stride + head * head_stride + d: unit stride along D.
    q_rows, k_rows, v_rows = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    cache = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()  # read one entry a token
    has_norm = q_weight is not None
    q_parts = cdiv(q_heads, kv_heads)
    q_part_heads = cdiv(q_heads, q_parts)
    block_hq, block_hk = next_power_of_2(q_part_heads), next_power_of_2(kv_heads)
    block_half = next_power_of_2(half)
    # Several tokens a program on large batches, 4 warps: of the tiles of 1 to 16 Qwen3-0.6B
    # tokens and the 2 to 8 warps tried, the fastest at 4096 and 32768 tokens. Sized by the k
    # tile, never narrower than a q part's.
    token_k_elements = 2 * block_hk * block_half
    block_t = rows_per_program(n_tokens, token_k_elements, q_parts + 2, _TOKEN_TILE_ELEMENTS)
    programs = cdiv(n_tokens, block_t) * (q_parts + 2)
    _qk_norm_rope_store_kernel[(programs,)](
        q_rows, q_rows.stride(0), q_rows.stride(1), k_rows, k_rows.stride(0), k_rows.stride(1),
        v_rows, v_rows.stride(0), v_rows.stride(1), positions, cache, cache.stride(0),
        q_weight.contiguous() if has_norm else cache, k_weight.contiguous() if has_norm else cache, eps,
        slot_mapping, k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3],
        inverse_scale(k_scale), inverse_scale(v_scale), n_tokens, q_heads, kv_heads, half, k_cache.shape[1],
        q_part_heads,
        HAS_NORM=has_norm, Q_PARTS=q_parts, BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        # at most 8 warps: on tiles of 4 tokens of Qwen3-0.6B's 16 q heads, 16 were slower at
        # 32768 tokens (docs/rejected.md)
        num_warps=num_warps(block_t * token_k_elements, programs, 16, 8),
        **dependent_launch(q.get_device()))
    if q_rows is not q:
        q.copy_(q_rows)
    return q
