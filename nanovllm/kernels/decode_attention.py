"""Decode attention with what lies between the qkv projection and it in the same kernel:
Qwen3's per-head q/k norms (optional), rotary, the write of the step's key and value into the
paged cache, and attention over the cache split across programs. Decode steps whose grid is
split at least _MIN_SPLITS ways (a few sequences) run it, then the split merge; other steps
(prefill, chunked prefill, mixed batches, larger decode batches) take qk_norm_rope_store and
paged attention. docs/attention.md has the design, docs/performance.md the measurements.

At those sizes a kernel's cost is mostly its fixed latency, so the layer's separate
qk_norm_rope_store launch is the saving (its kernels and busy time a step against the two
kernels: docs/rejected.md). Every key a program reads from the cache
but the step's own was written by an earlier step, so the first key tile of a split loads
before the wait for the qkv projection (programmatic dependent launch); the step's own key
comes from registers and is stored once, by the program whose split holds it."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention import (LOG2E, dot_dtype, fp8_cache_products, keys_read, kv_rows, merge_splits,
                                        padded_head_dim, paged_attention, split_plan, split_rows)
from nanovllm.kernels.kv_cache import inverse_scale, to_cache
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.qk_norm_rope import norm_rope, qk_norm_rope_store
from nanovllm.kernels.tiling import next_power_of_2

# Planned splits from which decode steps take the fused kernel. Its key tiles are gathered 64
# keys at a time in head halves, and over long splits they stream slower than paged
# attention's 128-key tiles, so steps split fewer ways keep the two kernels (the step times
# both ways: docs/rejected.md).
_MIN_SPLITS = 8
_NUM_STAGES = 3  # of 2 to 5, 3 and 4 the fastest (5 measured: docs/rejected.md)
_NUM_WARPS = 4  # 8 measured slower (docs/rejected.md)


def _block_n(head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Keys a tile holds, and the fewest a split gets: at batch 1 a short split is the one tile
    loaded before the wait. Its K and V sit in registers across the wait, so wider heads and
    fp32 caches on a GPU take fewer keys (the interpreter keeps the bf16 tiles)."""
    if dtype == torch.float32 and device.type == "cuda":
        return 16
    return 64 if head_dim <= 128 else 32


@triton.jit
def _head_halves(ptr, offsets, row_mask, cols, half):
    """[rows, half] first and second halves of the head rows at ptr + offsets, in fp32."""
    mask = row_mask[:, None] & (cols < half)[None, :]
    first = ptr + offsets[:, None] + cols[None, :]
    return (tl.load(first, mask=mask, other=0.0).to(tl.float32),
            tl.load(first + half, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _key_tile(block_table_row, k_head_ptr, v_head_ptr, start, first_key, cached_hi, offs_n, cols, half,
              stride_btc, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """K and V halves of keys start..start+BLOCK_N and the mask of those the query sees
    (first_key <= key < cached_hi). Tiles not MASKED are all cached and visible: their loads
    are masked only along a padded head. A masked tile wholly past the cached keys (a split
    past the sequence's end, loaded before the exit) takes its addresses from key 0: its
    block-table column may lie past the table."""
    pos = start + offs_n
    visible = (pos >= first_key) & (pos < cached_hi)
    if MASKED:
        start = tl.where(start < cached_hi, start, 0)
        mask = visible[:, None] & (cols < half)[None, :]
    else:
        mask = (cols < half)[None, :]
    k_rows, v_rows = kv_rows(block_table_row, start, offs_n, visible, stride_btc, stride_kb, stride_kt, stride_vb,
                              stride_vt, BLOCK_N, BLOCK_SIZE)
    k_first = k_head_ptr + k_rows[:, None] + cols[None, :]
    v_first = v_head_ptr + v_rows[:, None] + cols[None, :]
    return (tl.load(k_first, mask=mask, other=0.0), tl.load(k_first + half, mask=mask, other=0.0),
            tl.load(v_first, mask=mask, other=0.0), tl.load(v_first + half, mask=mask, other=0.0), visible)


@triton.jit
def _attend_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, visible, qk_scale, DOT_PRECISION: tl.constexpr,
                 MASKED: tl.constexpr):
    """One online-softmax step; q, K and V in halves along the head dimension (the pairs rotary
    mixes), so the rotated query needs no reassembly. Only MASKED tiles read `visible`. A
    float8 cache's tiles are upcast to q's dtype (other caches' are q's already)."""
    k1, k2, v1, v2 = k1.to(q1.dtype), k2.to(q1.dtype), v1.to(q1.dtype), v2.to(q1.dtype)
    qk = tl.dot(q1, tl.trans(k1), tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION),
                input_precision=DOT_PRECISION)
    if MASKED:
        qk = tl.where(visible[None, :], qk * qk_scale, float("-inf"))
    else:
        qk = qk * qk_scale
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    p_v = p.to(v1.dtype)
    acc1 = tl.dot(p_v, v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
    acc2 = tl.dot(p_v, v2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
    return acc1, acc2, m_new, l_i * alpha + tl.sum(p, 1)


@fast_launch
@triton.jit(do_not_specialize=["eps", "min_partition", "num_splits", "window", "stride_btr"])
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, slot_mapping_ptr,
    k_cache_ptr, v_cache_ptr, partial_ptr, lse_ptr, seq_lens_ptr, block_tables_ptr,
    eps, qk_scale, k_inv_scale, v_inv_scale, v_scale, min_partition, num_splits, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kb, stride_kt_cache, stride_kh_cache, stride_vb, stride_vt_cache, stride_vh_cache,
    stride_btr, stride_btc,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PRODUCTS_FP16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence x kv head, 1, split): the grid and partial layout of paged attention's
    split decode. Token t is sequence t's one query; its key, at position seq_len - 1, is not
    in the cache yet. Rows are the GQA group's query heads. Writes the normalised partial
    output and its log2-sum-exp for _merge_splits_kernel. With KV_FP8 the products take q's
    dtype (fp16 for bf16 queries: PRODUCTS_FP16), qk_scale holds the key scale, and the step's
    key and value are scored as the cache holds them."""
    pair = tl.program_id(0)
    seq = pair // NUM_KV_HEADS
    kv_head = pair % NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    new_key = seq_len - 1
    first_key = 0
    if WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    lo = first_key // BLOCK_N * BLOCK_N
    # Keys per split from this sequence's length, as in paged attention's split.
    partition = tl.maximum(min_partition, tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N)
    lo += tl.program_id(2) * partition
    hi = tl.minimum(seq_len, lo + partition)
    cached_hi = tl.minimum(hi, new_key)
    half = HEAD_DIM // 2
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_HALF)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btr
    k_head_ptr = k_cache_ptr + kv_head * stride_kh_cache
    v_head_ptr = v_cache_ptr + kv_head * stride_vh_cache
    token = seq.to(tl.int64)
    # Before the wait: step metadata (the position, its rotary row, the slot) is written before
    # the step's kernels run, cached keys by earlier steps.
    k1, k2, v1, v2, visible = _key_tile(block_table_row, k_head_ptr, v_head_ptr, lo, first_key, cached_hi, offs_n,
                                        cols, half, stride_btc, stride_kb, stride_kt_cache, stride_vb,
                                        stride_vt_cache, BLOCK_N, BLOCK_SIZE, True)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # other=0: the padded lanes of a half (head dim 96) enter the dot products
    cos = tl.load(cos_sin_ptr + position * stride_cs + cols, mask=cols < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cs + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int32)
    # Every program waits, even one with nothing to do: were all to leave without waiting, the
    # kernel could finish ahead of its predecessor and release the next kernel too early.
    await_previous_kernel(PDL)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP
    head = kv_head * GROUP + rows
    split_row = split_rows(token, head, num_splits, NUM_KV_HEADS * GROUP)
    if lo >= hi:
        # Past the sequence's keys (a short sequence's later splits, a padding sequence with
        # seq_len 0): lse = -inf tells the merge to skip the split.
        tl.store(lse_ptr + split_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_mask)
        return

    dtype = q_ptr.dtype.element_ty
    cache_dtype = k_cache_ptr.dtype.element_ty
    products_dtype = cache_dtype
    if KV_FP8:
        products_dtype = tl.float16 if PRODUCTS_FP16 else dtype
    # The split that holds the step's key (the last with keys: new_key >= lo, as lo < hi) loads
    # it with the query, one round trip for both, and writes it to the cache before its tiles:
    # no program reads that slot.
    holds_new = new_key < hi
    new_rows = (rows >= 0) & holds_new
    # Every row holds the same kv head's key and value: the score is a row-wise product, no
    # broadcast of a vector needed.
    same_head = tl.zeros([BLOCK_M], tl.int64) + kv_head
    q1, q2 = _head_halves(q_ptr + token * stride_qt, head * stride_qh, row_mask, cols, half)
    k_new1, k_new2 = _head_halves(k_ptr + token * stride_kt, same_head * stride_kh, new_rows, cols, half)
    v_new1, v_new2 = _head_halves(v_ptr + token * stride_vt, same_head * stride_vh, new_rows, cols, half)
    q1, q2 = norm_rope(q1, q2, q_weight_ptr, cos, sin, half, eps, cols, HAS_NORM, dtype)
    # rounded as the unfused path stores the rotated q, then reads it in the products' dtype
    if KV_FP8:
        q1 = fp8_cache_products(q1.to(dtype), PRODUCTS_FP16)
        q2 = fp8_cache_products(q2.to(dtype), PRODUCTS_FP16)
    else:
        q1 = q1.to(dtype).to(products_dtype)
        q2 = q2.to(dtype).to(products_dtype)
    k_new1, k_new2 = norm_rope(k_new1, k_new2, k_weight_ptr, cos, sin, half, eps, cols, HAS_NORM, dtype)
    k_new1 = to_cache(k_new1.to(dtype), k_inv_scale, cache_dtype)
    k_new2 = to_cache(k_new2.to(dtype), k_inv_scale, cache_dtype)
    v_new1 = to_cache(v_new1, v_inv_scale, cache_dtype)
    v_new2 = to_cache(v_new2, v_inv_scale, cache_dtype)
    # int32 division, int64 products: block * stride exceeds 2^31 elements in large caches
    block, offset = (slot // BLOCK_SIZE).to(tl.int64), (slot % BLOCK_SIZE).to(tl.int64)
    # one row stored: the [rows, half] pointers all address it, masked to row 0
    store_mask = ((rows == 0) & (slot >= 0) & new_rows)[:, None] & (cols < half)[None, :]
    row_cols = rows[:, None] * 0 + cols[None, :]
    k_dest = k_head_ptr + block * stride_kb + offset * stride_kt_cache + row_cols
    v_dest = v_head_ptr + block * stride_vb + offset * stride_vt_cache + row_cols
    tl.store(k_dest, k_new1, mask=store_mask)
    tl.store(k_dest + half, k_new2, mask=store_mask)
    tl.store(v_dest, v_new1, mask=store_mask)
    tl.store(v_dest + half, v_new2, mask=store_mask)

    m_i = tl.zeros([BLOCK_M], tl.float32) - 1.0e30  # finite: see paged attention's kernel
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc1, acc2, m_i, l_i = _attend_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, visible, qk_scale,
                                        DOT_PRECISION, True)
    # Long splits: the full tiles after the first, then at most one that reaches past the
    # cached keys.
    full_hi = lo + tl.maximum((cached_hi - lo) // BLOCK_N, 1) * BLOCK_N
    if full_hi > lo + BLOCK_N:
        # Behind a branch: the software pipeline's prologue (the first iteration's loads, and a
        # wait for them after the loop) would otherwise run in splits of one tile too.
        for start in tl.range(lo + BLOCK_N, full_hi, BLOCK_N):
            k1, k2, v1, v2, visible = _key_tile(block_table_row, k_head_ptr, v_head_ptr, start, first_key,
                                                cached_hi, offs_n, cols, half, stride_btc, stride_kb,
                                                stride_kt_cache, stride_vb, stride_vt_cache, BLOCK_N, BLOCK_SIZE,
                                                False)
            acc1, acc2, m_i, l_i = _attend_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, visible, qk_scale,
                                                DOT_PRECISION, False)
    if full_hi < cached_hi:
        k1, k2, v1, v2, visible = _key_tile(block_table_row, k_head_ptr, v_head_ptr, full_hi, first_key, cached_hi,
                                            offs_n, cols, half, stride_btc, stride_kb, stride_kt_cache, stride_vb,
                                            stride_vt_cache, BLOCK_N, BLOCK_SIZE, True)
        acc1, acc2, m_i, l_i = _attend_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, visible, qk_scale,
                                            DOT_PRECISION, True)

    if holds_new:
        score = (tl.sum(q1.to(tl.float32) * k_new1.to(tl.float32), 1)
                 + tl.sum(q2.to(tl.float32) * k_new2.to(tl.float32), 1)) * qk_scale
        m_new = tl.maximum(m_i, score)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(score - m_new)
        # p in the products' dtype, as the tile step's second dot takes it
        p_v = p.to(products_dtype).to(tl.float32)[:, None]
        acc1 = acc1 * alpha[:, None] + p_v * v_new1.to(tl.float32)
        acc2 = acc2 * alpha[:, None] + p_v * v_new2.to(tl.float32)
        l_i = l_i * alpha + p
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc1 = acc1 / l_safe[:, None]
    acc2 = acc2 / l_safe[:, None]
    if KV_FP8:
        acc1 = acc1 * v_scale
        acc2 = acc2 * v_scale
    out_first = partial_ptr + split_row[:, None] * HEAD_DIM + cols[None, :]
    out_mask = row_mask[:, None] & (cols < half)[None, :]
    tl.store(out_first, acc1, mask=out_mask)
    tl.store(out_first + half, acc2, mask=out_mask)
    tl.store(lse_ptr + split_row, tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf")), mask=row_mask)


def qk_norm_rope_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, cu_seqlens_q,
                           seq_lens, block_tables, max_seqlen_q, scale, sliding_window=None, q_weight=None,
                           k_weight=None, eps: float = 1e-6, k_scale: float = 1.0, v_scale: float = 1.0,
                           num_splits: int | None = None):
    """See nanovllm.kernels.qk_norm_rope_attention. `num_splits` forces the KV split count (tests,
    benchmarks): a decode step whose forced count split_plan keeps above one takes the fused
    kernel, others the two kernels."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if max_seqlen_q == 1 and num_tokens == num_seqs > 0:
        block_n = _block_n(head_dim, dot_dtype(q, k_cache), q.device)
        max_kv = keys_read(block_tables, block_size, sliding_window, max_seqlen_q)
        splits, min_partition = split_plan(num_seqs * num_kv_heads, max_kv, block_n, q.device, num_splits,
                                           min_keys=block_n)
        if splits >= (2 if num_splits else _MIN_SPLITS):
            return _decode(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, seq_lens,
                           block_tables, scale, sliding_window or 0, q_weight, k_weight, eps, k_scale, v_scale,
                           splits, min_partition, block_n)
    q = qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight,
                           eps, k_scale=k_scale, v_scale=v_scale)
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                           block_tables=block_tables, max_seqlen_q=max_seqlen_q, scale=scale,
                           sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits)


def _decode(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, seq_lens, block_tables, scale,
            window: int, q_weight, k_weight, eps: float, k_scale: float, v_scale: float, splits: int,
            min_partition: int, block_n: int) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # rows are addressed as token * token_stride + head * head_stride + d: unit stride along D
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    cos_sin = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    has_norm = q_weight is not None
    block_half = padded_head_dim(head_dim // 2)
    partial = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(num_tokens * num_kv_heads, 1, splits)](
        q, k, v, positions.contiguous(), cos_sin, q_weight.contiguous() if has_norm else cos_sin,
        k_weight.contiguous() if has_norm else cos_sin, slot_mapping.contiguous(), k_cache, v_cache, partial, lse,
        seq_lens, block_tables, float(eps), scale * k_scale * LOG2E, inverse_scale(k_scale), inverse_scale(v_scale),
        v_scale, min_partition, splits, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *block_tables.stride(),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_HALF=block_half,
        BLOCK_M=max(16, next_power_of_2(group)), BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], HAS_NORM=has_norm,
        WINDOW=window > 0, DOT_PRECISION="ieee" if dot_dtype(q, k_cache) == torch.float32 else "tf32",
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        PRODUCTS_FP16=k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **dependent_launch(q.get_device()))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    merge_splits(partial, lse, out, padded_head_dim(head_dim))
    return out
