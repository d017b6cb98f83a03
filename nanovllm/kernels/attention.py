"""Triton paged attention: one kernel serves every step the scheduler produces (prefill,
prefix-cached or chunked prefill, decode, mixes of these), with an optional split of the KV
range across programs whose partial results a second kernel merges by log-sum-exp.
docs/attention.md describes the design."""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.gemv import prefetch_l2
from nanovllm.kernels.interpreter import INTERPRETER
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2

LOG2E = 1.4426950408889634
FP16_MAX = tl.constexpr(65504.0)
# Splitting aims at this many working programs per SM: one program's loads in flight while
# another computes, and long splits, few partials (more splits measured slower:
# docs/rejected.md).
_PROGRAMS_PER_SM = 2
# Fewest keys per split (two decode key tiles), so that a short sequence does not spread over
# programs that each load a tile or two.
_MIN_PARTITION = 128
# The merge runs one warp a (token, head), each thread holding _MERGE_PER_THREAD fp32 values
# of a (splits x head dim) tile: 32 splits of head dim 128, every split of a column in one
# thread, so the sums over splits need no step across warps (a 4-warp tile measured slower:
# docs/rejected.md). More splits come a tile at a time.
_MERGE_PER_THREAD = 128
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
# Sequence x kv-head pairs whose query tiles run together (_pair_and_tile): 4 pairs of 2048
# keys hold 4 MB of bf16 K and V, well inside a Hopper's 50 MB L2. Launch order and groups of
# 8 or 16 measured slower (docs/rejected.md).
PAIRS_PER_GROUP = 4
# Decode programs take every kv head of a sequence where their keys fit a row this wide, the
# query heads one tile of this many rows, and a cache block holds whole key tiles of the packed
# config (_kv_heads_packed).
_PACKED_ROW = 128
_PACKED_QUERY_HEADS = 16
_PACKED_MIN_BLOCK = 64
# Unsplit decode programs load their first key tile before the PDL wait for head dims up to
# this. With heads of 128 the tile held across the wait took the kernel from 127 to 155
# registers a thread, a program fewer an SM, and measured slower (docs/rejected.md).
_PRELOAD_MAX_HEAD_DIM = 64
# With the first tile loaded early the loops have one tile fewer, and two stages keep pace
# (three measured slower: docs/rejected.md).
_PRELOAD_STAGES = 2


class TileConfig(NamedTuple):
    block_m: int  # (query row, head of the group) pairs per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    tma: bool = False  # full key tiles by TMA descriptor where the cache allows (_kv_descriptors)


_fitted_configs: dict[tuple, TileConfig] = {}  # see _with_fallback


@triton.jit
def _load_rows(ptrs, row_mask, d_mask, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    # Unmasked loads where the bounds are known at compile time keep them vectorised.
    if MASK_ROWS:
        if MASK_D:
            x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if MASK_D:
            x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _tile_block(block_table_row, start, stride_btc, BLOCK_SIZE: tl.constexpr):
    """Block id of a key tile that lies in one cache block (BLOCK_N <= BLOCK_SIZE): tiles start
    at multiples of BLOCK_N, which divides BLOCK_SIZE, so it is that of the tile's first key,
    which is below `hi` and so owned by the sequence. One scalar load, not BLOCK_N."""
    return tl.load(block_table_row + (start // BLOCK_SIZE) * stride_btc)


@triton.jit
def kv_rows(block_table_row, start, offs_n, in_range, stride_btc, stride_kb, stride_kt, stride_vb, stride_vt,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Offsets of keys start + offs_n in the K and V caches."""
    if BLOCK_N <= BLOCK_SIZE:
        block = _tile_block(block_table_row, start, stride_btc, BLOCK_SIZE).to(tl.int64)
        slot = start % BLOCK_SIZE + offs_n
    else:
        # Keys at or past `hi` read no block-table entry: padding entries may be garbage.
        pos = start + offs_n
        block = tl.load(block_table_row + (pos // BLOCK_SIZE) * stride_btc, mask=in_range, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
    # int64: block * stride_kb exceeds 2^31 elements in large caches.
    return block * stride_kb + slot * stride_kt, block * stride_vb + slot * stride_vt


@triton.jit
def _attend_kv_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, kv_col, block_table_row, start, hi,
                    first_key, row_first, row_limit, qk_scale, offs_n, offs_d, d_mask, stride_btc, stride_kb,
                    stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, PAD_D: tl.constexpr,
                    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """One online-softmax step over keys start..start+BLOCK_N. MASKED tiles may reach `hi` (one
    past the program's last key) or a row's causal limit, and with WINDOW the first key of a
    row's window (row_first); others lie wholly inside every row's range. With USE_TMA,
    k_desc/v_desc describe the caches as [slots, kv heads * head dim] and kv_col is this head's
    first column."""
    pos = start + offs_n
    in_range = pos < hi
    if WINDOW:
        # Keys below the tile's first visible key may lie in blocks wholly outside the window:
        # neither their block ids nor their rows are loaded.
        in_range &= pos >= first_key
    if USE_TMA and not MASKED:
        # The whole tile is keys the sequence wrote, consecutive rows of one cache block: a bulk
        # tensor copy each for K and V, no per-row addresses. (Masked tiles may reach unwritten
        # rows, whose garbage V, even times p = 0, could be NaN: they keep masked loads.)
        cache_row = _tile_block(block_table_row, start, stride_btc, BLOCK_SIZE) * BLOCK_SIZE + start % BLOCK_SIZE
        k = k_desc.load([cache_row, kv_col])
        v = v_desc.load([cache_row, kv_col])
    else:
        k_rows, v_rows = kv_rows(block_table_row, start, offs_n, in_range, stride_btc, stride_kb, stride_kt,
                                  stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE)
        k = _load_rows(k_head_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd, in_range, d_mask, MASKED, PAD_D)
        v = _load_rows(v_head_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, in_range, d_mask, MASKED, PAD_D)
    return _softmax_step(acc, m_i, l_i, q, k, v, pos, row_first, row_limit, qk_scale, MASKED, DOT_PRECISION, WINDOW)


@triton.jit
def fp8_cache_products(q, PRODUCTS_FP16: tl.constexpr):
    """Query rows in the dtype of the products over a float8 cache: q's own, but fp16 for bf16
    queries, saturated to its range (exact below it): e4m3 tiles upcast to fp16 in one
    instruction a pair of values and to bf16 in four, which bounded the decode kernels."""
    if PRODUCTS_FP16:
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    return q


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, pos, row_first, row_limit, qk_scale, MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """The online-softmax update with the key tile k, v at key positions `pos`. Tiles of a
    float8 cache are upcast to q's dtype here, in registers (other caches' are q's already)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    # The scale goes into the exponent as one fused multiply-add per score (exp2 and that FMA
    # are the softmax's per-score work); m is kept in scaled units (qk_scale > 0).
    if MASKED:
        visible = pos[None, :] < row_limit[:, None]
        if WINDOW:
            visible &= pos[None, :] >= row_first[:, None]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def split_rows(token, head, num_splits, NUM_HEADS: tl.constexpr):
    """Rows of this program's split in the [tokens, heads, splits] scratch buffers. Computed
    where needed rather than once: kept live across the key loops it cost prefill tiles 40
    registers (sm_90)."""
    return (token * NUM_HEADS + head) * num_splits + tl.program_id(2)


@triton.jit
def _pair_and_tile(PAIRS_PER_GROUP: tl.constexpr):
    """(sequence x kv head pair, query tile) of this program. The GPU starts programs in
    launch order (x fastest, then y); that order is remapped so that PAIRS_PER_GROUP pairs run
    all their query tiles before the next pairs start, the longest causal tiles of the group
    first. The tiles of a pair read the same keys, so its K and V come from DRAM about once
    and from L2 after; with the pairs of the whole batch in flight at once they would not fit
    in L2. Decode grids (one tile a pair) keep their order."""
    pairs = tl.num_programs(0)
    tiles = tl.num_programs(1)
    launched = tl.program_id(1) * pairs + tl.program_id(0)
    group = launched // (PAIRS_PER_GROUP * tiles)
    first_pair = group * PAIRS_PER_GROUP
    group_pairs = tl.minimum(pairs - first_pair, PAIRS_PER_GROUP)
    rank = launched - first_pair * tiles
    return first_pair + rank % group_pairs, tiles - 1 - rank // group_pairs


# Values that change from step to step (the block-table width too) must not each compile a
# kernel of their own.
@fast_launch
@triton.jit(do_not_specialize=["min_partition", "num_splits", "stride_btr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, v_scale, min_partition, num_splits, window,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btr, stride_btc,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr, PAIRS_PER_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, KV_PACK: tl.constexpr, PRELOAD: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr, KV_FP8: tl.constexpr, PRODUCTS_FP16: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence x kv head, query tile, KV split). Its BLOCK_M rows are (query row,
    query head) pairs of the GQA group of one kv head, row-major, so each K/V tile loaded
    serves the whole group. Without SPLIT it writes the output; with SPLIT, the normalised
    partial output and its log2-sum-exp for _merge_splits_kernel. With WINDOW (causal only), a
    row sees only the `window` keys ending at its own position; the key loop starts at the
    tile holding the first row's first visible key, and splits share out only the keys from
    there. With KV_PACK > 1 (decode only) the launcher passes KV_PACK adjacent kv heads as one
    of KV_PACK times the head dim, and their query heads as one group: each q row is loaded
    into its own head's columns and zeros elsewhere, so one product scores it against its own
    head's keys, and its output is stored from those columns. With PRELOAD (decode, unsplit,
    no window, heads of 64 or less), the first key tile below the step's own keys is loaded
    before the wait: earlier steps wrote it; with PREFETCH_NEXT too (tiles spanning several
    cache blocks), the next tile's rows are requested into L2 at the same point. With KV_FP8
    the products take q's dtype (fp16 for bf16 queries: PRODUCTS_FP16), qk_scale holds the key
    scale and v_scale scales the output."""
    pair, tile = _pair_and_tile(PAIRS_PER_GROUP)
    seq = pair // NUM_KV_HEADS
    kv_head = pair % NUM_KV_HEADS
    # All three loads before the first exit, which needs two of them: their latencies overlap.
    # They come before the wait for the previous kernel, while it finishes: step metadata is
    # written before the step's kernels run, never by a kernel of this package.
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q_len = q_end - q_start
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btr
    if PRELOAD:
        # The step's own keys, the last q_len, are the kernel before's output; keys below them
        # were written by earlier steps, so the first tile of those is read while it finishes.
        # Only a whole tile is: a shorter run of written keys is read by the loops, once.
        pre_keys = tl.where(seq_len - q_len >= BLOCK_N, BLOCK_N, 0)
        pre_in = offs_n < pre_keys
        pre_k_rows, pre_v_rows = kv_rows(block_table_row, 0, offs_n, pre_in, stride_btc, stride_kb, stride_kt,
                                          stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE)
        pre_k = _load_rows(k_head_ptr + pre_k_rows[:, None] + offs_d[None, :] * stride_kd, pre_in, d_mask, True,
                           PAD_D)
        pre_v = _load_rows(v_head_ptr + pre_v_rows[:, None] + offs_d[None, :] * stride_vd, pre_in, d_mask, True,
                           PAD_D)
        if PREFETCH_NEXT:
            # Rows gathered from small blocks: the loop's first tile, requested only after the
            # wait and the query's load, would otherwise start its round trips then.
            next_in = BLOCK_N + offs_n < seq_len - q_len
            next_k_rows, next_v_rows = kv_rows(block_table_row, BLOCK_N, offs_n, next_in, stride_btc, stride_kb,
                                                stride_kt, stride_vb, stride_vt, BLOCK_N, BLOCK_SIZE)
            prefetch_l2(k_head_ptr + next_k_rows)
            prefetch_l2(v_head_ptr + next_v_rows)
    # Before the exit: were every program to leave without waiting, the kernel could finish
    # ahead of its predecessor and release the next kernel too early.
    await_previous_kernel(PDL)
    if tile * BLOCK_M >= q_len * GROUP:
        return

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = offs_m < q_len * GROUP
    token = (q_start + row).to(tl.int64)

    first_visible_end = seq_len - q_len + 1  # causal: row r sees keys < first_visible_end + r
    first_row = tile * BLOCK_M // GROUP
    last_row = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    # The first key any row of the tile sees: below it, whole key tiles are skipped.
    first_key = 0
    if WINDOW:
        first_key = tl.maximum(first_visible_end + first_row - window, 0)
    lo = first_key // BLOCK_N * BLOCK_N
    if PRELOAD:  # the loops start after the preloaded tile, or at key 0 where there is none
        lo = pre_keys
    hi = seq_len
    if SPLIT:
        # Keys per split from this sequence's own length: the host knows only the block table's
        # width (max_model_len in a decode graph), so a split count fixed there would leave a
        # short sequence on one or two programs. Its splits past the last key exit at once.
        partition = tl.maximum(min_partition, tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N)
        lo += tl.program_id(2) * partition
        hi = tl.minimum(hi, lo + partition)
    # Keys in [full_lo, full_hi) are visible to every row of the tile; keys in [lo, hi) to some.
    full_hi = hi
    row_limit = tl.zeros([BLOCK_M], tl.int32) + hi
    if CAUSAL:
        full_hi = tl.minimum(hi, first_visible_end + first_row)
        hi = tl.minimum(hi, first_visible_end + last_row)
        row_limit = tl.minimum(row_limit, first_visible_end + row)
    full_hi = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N
    full_lo = lo
    row_first = row_limit  # unread without WINDOW
    if WINDOW:
        row_first = first_visible_end + row - window
        # Rounded up to a key tile; where the tile's rows span more than the window, no key
        # tile is inside every row's window and the masked loops cover the whole range.
        last_row_first = tl.maximum(first_visible_end + last_row - window, 0)
        full_lo = tl.minimum(tl.maximum(tl.cdiv(last_row_first, BLOCK_N) * BLOCK_N, lo), full_hi)

    if SPLIT:
        if lo >= hi:
            # No row of the tile sees a key of this split: past seq_len (most splits of a short
            # sequence in a padded decode graph) or past every row's causal limit. lse = -inf
            # alone tells the merge to skip the split, partial output unread.
            split_row = split_rows(token, head, num_splits, NUM_KV_HEADS * GROUP)
            tl.store(lse_ptr + split_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_mask)
            return

    if KV_PACK > 1:
        q_cols = offs_d % (HEAD_DIM // KV_PACK)
        own_cols = (offs_d // (HEAD_DIM // KV_PACK))[None, :] == (head // (GROUP // KV_PACK))[:, None]
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + q_cols[None, :] * stride_qd,
                    mask=row_mask[:, None] & own_cols, other=0.0)
    else:
        q = _load_rows(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                       row_mask, d_mask, True, PAD_D)
    if KV_FP8:
        q = fp8_cache_products(q, PRODUCTS_FP16)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # m starts finite so that a row whose first tiles are all masked gets exp2(-inf - m) = 0, not NaN.
    m_i = tl.zeros([BLOCK_M], tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if PRELOAD:
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, pre_k, pre_v, offs_n, row_first,
                                      tl.zeros([BLOCK_M], tl.int32) + pre_keys, qk_scale, True, DOT_PRECISION, False)
    kv_col = kv_head * HEAD_DIM
    for start in tl.range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, kv_col,
                                        block_table_row, start, hi, first_key, row_first, row_limit, qk_scale,
                                        offs_n, offs_d, d_mask, stride_btc, stride_kb, stride_kt, stride_kd,
                                        stride_vb, stride_vt, stride_vd,
                                        BLOCK_N, BLOCK_SIZE, False, PAD_D, USE_TMA, DOT_PRECISION, WINDOW)
    # The masked tiles on either side: [lo, full_lo), where rows' windows start apart (none
    # without WINDOW), then [full_hi, hi), where their causal limits or the keys end.
    low_tiles = (full_lo - lo) // BLOCK_N
    for i in tl.range(0, low_tiles + tl.cdiv(hi - full_hi, BLOCK_N)):
        start = tl.where(i < low_tiles, lo + i * BLOCK_N, full_hi + (i - low_tiles) * BLOCK_N)
        acc, m_i, l_i = _attend_kv_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, kv_col,
                                        block_table_row, start, hi, first_key, row_first, row_limit, qk_scale,
                                        offs_n, offs_d, d_mask, stride_btc, stride_kb, stride_kt, stride_kd,
                                        stride_vb, stride_vt, stride_vd,
                                        BLOCK_N, BLOCK_SIZE, True, PAD_D, False, DOT_PRECISION, WINDOW)

    # A row that saw no key (seq_len 0, or all its keys in other splits) has l = 0: it yields zeros.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if KV_FP8:
        acc = acc * v_scale
    store_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        split_row = split_rows(token, head, num_splits, NUM_KV_HEADS * GROUP)
        tl.store(out_ptr + split_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
        tl.store(lse_ptr + split_row, tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf")), mask=row_mask)
    elif KV_PACK > 1:
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + q_cols[None, :] * stride_od
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & own_cols)
    else:
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


@fast_launch
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_splits, stride_ot, stride_oh, stride_od,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """out[token, head] = sum_s 2^(lse_s - lse) * partial_s, lse = log2 sum_s 2^lse_s. Splits
    come BLOCK_S at a time, each chunk as one tile of independent loads: with BLOCK_S at least
    the split count (the usual case) the loop runs once, and its latency is that of one round
    of loads (lse and partials together), whatever the number of splits."""
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = (token * NUM_HEADS + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # Finite start, as in the main kernel: if every split is empty (lse = -inf), all weights are
    # exp2(-inf - m) = 0, not NaN.
    m = -1.0e30
    weight_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for chunk in tl.range(0, num_splits, BLOCK_S):
        split = chunk + offs_s
        in_range = split < num_splits
        lse = tl.load(lse_ptr + first + split, mask=in_range, other=float("-inf"))
        # Loaded with the lse values, not after them: one memory round trip, not two. A split
        # that saw no key may have left its partial unwritten (garbage, NaN even): it weighs 0
        # and is selected away below, never multiplied.
        partial = tl.load(partial_ptr + (first + split)[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=in_range[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        weight = tl.math.exp2(lse - m_new)
        partial = tl.where((weight > 0.0)[:, None], partial, 0.0)
        alpha = tl.math.exp2(m - m_new)
        acc = acc * alpha + tl.sum(weight[:, None] * partial, 0)
        weight_sum = weight_sum * alpha + tl.sum(weight, 0)
        m = m_new
    acc = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_config(head_dim: int, group: int, max_seqlen_q: int, dtype: torch.dtype,
                   device: torch.device, split: bool = False, block_size: int = 0) -> TileConfig:
    """Tiles for H100/H200, checked there for shared memory and register spills. Decode steps
    (max_seqlen_q == 1) are bandwidth bound: the smallest M that tl.dot takes. Longer queries
    are compute bound: M of 128 for the tensor cores. `split`: the grid is split (see
    split_plan), so at most about two programs share an SM. `block_size`: the KV cache's."""
    block_d = padded_head_dim(head_dim)
    if dtype == torch.float32 and device.type == "cuda":
        return TileConfig(16, 16, 4, 2)  # exact fp32 dots hold their operands in registers
    if max_seqlen_q == 1:
        block_m = max(16, next_power_of_2(group))
        if split and block_d <= 128 and block_size >= 128 and block_size % 128 == 0:
            # A split grid has room on each SM for deep pipelines: key tiles of 128 by TMA,
            # 4 stages (faster than the gathered 64-key tiles below: docs/rejected.md).
            return TileConfig(block_m, 128, 4, 4, tma=True)
        # Split: 5 stages, faster than 3. Unsplit grids need their programs two an SM, which 5
        # stages would halve (both measured: docs/rejected.md).
        stages = 5 if split and block_d <= 128 else 3
        if not split and block_d <= 64:
            # Heads of 64 leave a program little to read: 128-key tiles halve its loop trips
            # (64-key tiles measured slower: docs/rejected.md).
            return TileConfig(block_m, 128, 4, 3)
        return TileConfig(block_m, 64 if block_d <= 128 else 32, 4, stages)
    if block_d <= 64:
        return TileConfig(128, 64, 4, 3, tma=True)
    if block_d <= 128:
        # 5 stages and TMA: each measured faster on prefill than without (docs/rejected.md)
        return TileConfig(128, 64, 8, 5, tma=True)
    return TileConfig(128, 32, 8, 2)


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter has no SMs; a small count lets CPU tests reach the split path.
    return 4


@functools.cache
def _has_tma(device: torch.device) -> bool:
    # The interpreter (CPU tensors) runs descriptor loads too, so CI covers that path.
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def split_plan(programs: int, max_kv: int, block_n: int, device: torch.device,
               num_splits: int | None = None, min_keys: int = _MIN_PARTITION) -> tuple[int, int]:
    """(splits, fewest keys per split) from host-known shapes only. The kernel cuts each
    sequence's keys into at most `splits` partitions of at least that many keys, multiples of
    block_n (its key tiles rely on starting at multiples of BLOCK_N). Splits only when the
    unsplit grid fills less than one wave, then aims at _PROGRAMS_PER_SM programs per SM,
    rounded down to a power of two so that the merge loads whole tiles of splits (33 splits'
    merge takes a 64-split tile, measured slower: docs/rejected.md). At least `min_keys` keys a
    split, rounded up to key tiles; a forced `num_splits` (tests, benchmarks) may cut as fine as
    one key tile."""
    min_partition = block_n
    if num_splits is None:
        sms = _multiprocessor_count(device)
        num_splits = 1 if programs >= sms else 1 << ((_PROGRAMS_PER_SM * sms // programs).bit_length() - 1)
        min_partition = cdiv(min_keys, block_n) * block_n
    return max(1, min(num_splits, _MAX_GRID_YZ, cdiv(max_kv, min_partition))), min_partition


def keys_read(block_tables, block_size: int, sliding_window: int | None, max_seqlen_q: int) -> int:
    """The most keys one query tile may read, from host-known shapes: the block table's width,
    or with a sliding window its rows' windows."""
    max_kv = block_tables.shape[1] * block_size
    return min(max_kv, sliding_window + max_seqlen_q - 1) if sliding_window else max_kv


def dot_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype of the kernels' products: the cache's, or over a float8 cache, whose tiles are
    upcast in registers, q's (fp16 for bf16 queries: fp8_cache_products)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return k_cache.dtype
    return torch.float16 if q.dtype == torch.bfloat16 else q.dtype


def paged_attention(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal=True,
                    sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    num_splits: int | None = None, config: TileConfig | None = None, cuda_decode: bool = False):
    """See nanovllm.kernels.paged_attention. Beyond it: `num_splits` forces the KV split count
    (1: none) and `config` the Triton tiles; `cuda_decode` whether unsplit decode steps that
    kernels/cuda/paged_decode serves run that CUDA C++ kernel (dispatch.py passes what
    NANOVLLM_PAGED_DECODE says; never where `num_splits` or `config` is forced); all but
    `cuda_decode` for tests and benchmarks. Output rows that no
    sequence owns (past cu_seqlens_q[-1]) are left unwritten."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    forced_config = config
    dtype = dot_dtype(q, k_cache)
    config = config or default_config(head_dim, group, max_seqlen_q, dtype, q.device, block_size=block_size)
    q_tiles = cdiv(max_seqlen_q * group, config.block_m)
    if q_tiles > _MAX_GRID_YZ:
        raise ValueError(f"max_seqlen_q: {max_seqlen_q} query rows need {q_tiles} tiles, over the grid limit")
    programs = num_seqs * num_kv_heads * q_tiles
    max_kv = keys_read(block_tables, block_size, sliding_window, max_seqlen_q)
    splits, min_partition = split_plan(programs, max_kv, config.block_n, q.device, num_splits)
    if forced_config is None and splits > 1:  # a deeper pipeline, maybe wider key tiles
        config = default_config(head_dim, group, max_seqlen_q, dtype, q.device, True, block_size)
        # partitions are multiples of the key tile the kernel runs
        splits, min_partition = split_plan(programs, max_kv, config.block_n, q.device, num_splits)
    cuda_decode = cuda_decode and forced_config is None and num_splits is None
    ext = cuda_decode and cuda_decode_module(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q,
                                             splits, sliding_window)
    if ext:
        from nanovllm.kernels.cuda import paged_decode
        return paged_decode.paged_decode(ext, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                         k_scale, v_scale, dependent_launch(q.get_device())["PDL"])
    kv_pack = _kv_heads_packed(k_cache, v_cache, num_heads, max_seqlen_q, num_seqs, splits)
    if kv_pack > 1:
        k_cache, v_cache = (cache.view(*cache.shape[:2], 1, kv_pack * head_dim) for cache in (k_cache, v_cache))
        num_kv_heads, group, head_dim = 1, num_heads, kv_pack * head_dim
        config = forced_config or default_config(head_dim, group, 1, dtype, q.device, block_size=block_size)
        q_tiles = cdiv(group, config.block_m)
    block_d = padded_head_dim(head_dim)
    preload = max_seqlen_q == 1 and splits == 1 and not sliding_window and block_d <= _PRELOAD_MAX_HEAD_DIM
    if preload and forced_config is None:
        config = config._replace(num_stages=_PRELOAD_STAGES)
    launch = functools.partial(
        _launch_attention, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale * k_scale, v_scale, causal,
        sliding_window or 0, (num_seqs * num_kv_heads, q_tiles, splits), min_partition, block_d, kv_pack, preload)
    shape_class = (q.device, q.dtype, k_cache.dtype, head_dim, group, num_kv_heads, block_size, bool(causal),
                   bool(sliding_window), kv_pack)
    if splits == 1:
        _with_fallback(launch, config, out, out, False, shape_class)
        return out
    partial = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    _with_fallback(launch, config, partial, lse, True, shape_class)
    merge_splits(partial, lse, out, block_d)
    return out


def cuda_decode_module(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q: int, splits: int,
                       sliding_window):
    """The built CUDA C++ decode kernel's module where it serves this call (a decode step of an
    unsplit grid, no window, operands kernels/cuda/paged_decode.supports takes), else None."""
    if max_seqlen_q != 1 or splits != 1 or sliding_window or INTERPRETER:
        return None
    from nanovllm.kernels.cuda import paged_decode
    if not paged_decode.supports(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables):
        return None
    return paged_decode.module()


def _kv_heads_packed(k_cache, v_cache, num_heads: int, max_seqlen_q: int, num_seqs: int, splits: int) -> int:
    """How many kv heads one decode program takes (1: its own only). All of them where their
    keys fit one 128-wide row (2 heads of 64: Qwen2.5-0.5B) and every query head one tile, so
    a program reads each key's heads as one contiguous row and the grid has a program a
    sequence; only for grids that stay one program an SM or more unsplit, and for blocks that
    hold whole 64-key tiles (faster there; slower in blocks of 16, whose tiles gather rows of
    several blocks: docs/rejected.md)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if not (max_seqlen_q == 1 and splits == 1 and 1 < num_kv_heads and num_kv_heads * head_dim <= _PACKED_ROW
            and block_size >= _PACKED_MIN_BLOCK
            and head_dim == padded_head_dim(head_dim) and num_heads <= _PACKED_QUERY_HEADS
            and num_seqs >= _multiprocessor_count(k_cache.device)):
        return 1
    dense = all(c.stride(3) == 1 and c.stride(2) == head_dim for c in (k_cache, v_cache))
    return num_kv_heads if dense else 1


def merge_splits(partial, lse, out, block_d: int) -> None:
    num_tokens, num_heads, splits, head_dim = partial.shape
    # A power of two (one compiled variant per doubling of the split count), all splits at
    # once unless they pass one warp's tile.
    block_s = min(next_power_of_2(splits), max(1, 32 * _MERGE_PER_THREAD // block_d))
    _merge_splits_kernel[(num_tokens, num_heads)](
        partial, lse, out, splits, *out.stride(), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=block_s, num_warps=1, **dependent_launch(out.get_device()))


def _with_fallback(launch, config: TileConfig, out, lse, split: bool, shape_class: tuple) -> None:
    """Launches with `config`, or, on a GPU with less shared memory than the config was made
    for, with fewer stages and then narrower key tiles; remembers what fitted, so only the
    first call of a shape class (which compiles, before any CUDA-graph capture) searches."""
    key = (config, split, shape_class)
    config = _fitted_configs.get(key, config)
    while True:
        try:
            launch(config, out, lse, split)
            break
        except OutOfResources:
            if config.num_stages > 1:
                config = config._replace(num_stages=config.num_stages - 1)
            elif config.block_n > 16:
                config = config._replace(block_n=config.block_n // 2)
            else:
                raise
    _fitted_configs[key] = config


def _kv_descriptors(k_cache, v_cache, config: TileConfig, block_d: int):
    """TMA descriptors of the caches as [slots, kv heads * head dim] for the full key tiles,
    or (None, None) where the kernel keeps gathering rows: configs without `tma`, GPUs before
    Hopper, key tiles that would span cache blocks, a padded head dim, caches that are not
    one dense array."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if not (config.tma and _has_tma(k_cache.device) and config.block_n <= block_size and head_dim == block_d
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(t.data_ptr() % 16 == 0 for t in (k_cache, v_cache))
            and num_kv_heads * head_dim * k_cache.element_size() % 16 == 0):
        return None, None
    shape, strides = [num_blocks * block_size, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1]
    tile = [config.block_n, block_d]
    return TensorDescriptor(k_cache, shape, strides, tile), TensorDescriptor(v_cache, shape, strides, tile)


def _launch_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, v_scale, causal, window: int,
                      grid, min_partition, block_d, kv_pack: int, preload: bool, config: TileConfig, out, lse,
                      split: bool) -> None:
    """`scale`: the softmax scale times the key scale."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_desc, v_desc = _kv_descriptors(k_cache, v_cache, config, block_d)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, out, lse, cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E, v_scale, min_partition, grid[2], window,
        *q.stride(), *(out.stride() if not split else (0, 0, 0)),
        *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        NUM_KV_HEADS=num_kv_heads, GROUP=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, KV_PACK=kv_pack,
        PRELOAD=preload,
        PREFETCH_NEXT=preload and config.block_n > k_cache.shape[1] and not INTERPRETER,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_SIZE=k_cache.shape[1],
        CAUSAL=bool(causal), SPLIT=split, USE_TMA=k_desc is not None, PAIRS_PER_GROUP=PAIRS_PER_GROUP,
        DOT_PRECISION="ieee" if dot_dtype(q, k_cache) == torch.float32 else "tf32", WINDOW=window > 0,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        PRODUCTS_FP16=k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch(q.get_device()))
