"""Sort-free sampling: per-row temperature, top-k, top-p, min-p and seeded Gumbel-max draws,
greedy rows in the same batch, and the chosen token's log-probability.

Three launches, each reading what it needs once:
- scan (rows x 4,096-token chunks): the one full read of the logits. Per chunk: its max, its
  sum of exp((x - max) / T) when log-probabilities are asked, its argmax, with Gumbel noise for
  rows that sample without filters, and for filtering rows the max of every 32-token group and,
  past 1,024 groups, the largest key (below) of every tile of min(1,024 / k_pad, 32) groups
  (k_pad: max_top_k rounded up to a power of two).
- min_p_draw (rows x chunks, launched only with min_ps): rows with min-p and no top-k / top-p
  draw again over their chunk, among tokens with (x - max) / T >= log(min_p).
- finalize (one program a row): rows with top-k / top-p pick the k groups holding the top k
  tokens (ranked by logit, ties by lower token id) by a radix select over their group maxima
  as order-preserving uint32 keys: 4 bits a pass, each pass one 16-bin histogram of the keys
  still level with the k-th, until those are exactly the ones needed. Past 1,024 groups the
  scan's tile keys are selected first, then the groups of the k best tiles (at most 1,024), so
  that either select holds a few keys a thread. The top k tokens lie among the k groups' tokens
  at or above the least of their maxima: when those are at least k and fit in k_pad slots, they
  alone are written out, else a radix select of the k * 32 tokens writes exactly the top k;
  a sort of k_pad keys ranks them. Top-k, min-p and top-p apply to the ranked list, whose first
  rank they always keep; the draw adds noise to those tokens only. Other rows take their best
  chunk. With log-probabilities, log_softmax(x / T)[token] from the chunk sums.

The noise of token t of a row depends on (seed, t) alone: Philox 4x32 (7 rounds, the fewest
that pass BigCrush) at counter t - t % 4n + t % n, output (t % 4n) // n, where the noise block
n = 1024 (32 to 512 for vocabularies under 4,096, so that small ones stay cheap). A seeded
row draws the same token in any batch. Gumbel noise in base 2: argmax(x log2(e) / T -
log2(-log2(u))) is the draw of softmax(x / T), one multiply-add and two fast logs a token.
Past max_top_k > SORT_FREE_TOP_K the filters come from a sort (reference.sampling_mask).

Every launch reads logits through _load_logits, which applies the penalties
(kernels.penalties) and the allowed-token bitmask where they are given; the finalize then
counts each penalized row's drawn token."""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from nanovllm.kernels import penalties as penalty_ops
from nanovllm.kernels import reference
from nanovllm.kernels.interpreter import INTERPRETER
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2

INTERPRETER = tl.constexpr(INTERPRETER)
SORT_FREE_TOP_K = 256  # the largest top-k (and top-p candidate count) filtered without a sort
NOISE_BLOCK = 1024  # tokens sharing one Philox call's four outputs, NOISE_BLOCK apart; a scan chunk holds four
GROUP = 32  # tokens a group maximum covers
SELECT = 1024  # group maxima one select of the finalize ranks; past it, tiles of groups go first
RADIX_BITS = 4  # key bits a radix pass decides: 16 bins, whose scan and sum stay within a warp
PHILOX_ROUNDS = 7
LOG2E = 1.4426950408889634
# Largest float32 below 1: u = 1 would make the noise +inf.
U_MAX = 0.99999994


@triton.jit
def _log2(x):
    """lg2.approx on a GPU (tl.log2 is libdevice's exact log2f, several times the instructions);
    the interpreter runs no libdevice."""
    if INTERPRETER:
        return tl.log2(x)
    return libdevice.fast_log2f(x)


@triton.jit
def _gumbel2(u, U_MAX: tl.constexpr):
    """Gumbel noise in base 2 (noise / ln 2 plus a constant): -log2(-log2(u))."""
    return -_log2(-_log2(tl.minimum(u, U_MAX)))


@triton.jit
def _token_noise(seed, tokens, NOISE_BLOCK: tl.constexpr, ROUNDS: tl.constexpr, U_MAX: tl.constexpr):
    """The scan's noise for arbitrary token ids: one Philox call a token, its output picked."""
    span = 4 * NOISE_BLOCK
    u0, u1, u2, u3 = tl.rand4x(seed, tokens - tokens % span + tokens % NOISE_BLOCK, ROUNDS)
    part = (tokens % span) // NOISE_BLOCK
    u = tl.where(part == 0, u0, tl.where(part == 1, u1, tl.where(part == 2, u2, u3)))
    return _gumbel2(u, U_MAX)


@triton.jit
def _load_logits(row_ptr, cols, vocab, row, edits, MASKED: tl.constexpr, PENALIZED: tl.constexpr):
    """The row's logits at cols in float32 as the draw sees them: -inf past the vocabulary;
    with PENALIZED, penalized as kernels.penalties.Penalties says where the row has a table
    row; with MASKED, -inf where the row's token bitmask clears the token's bit (bit col % 32
    of word col // 32). edits: the kernel's bitmask and penalty arguments (_edit_args)."""
    bitmask_ptr, bitmask_stride, rows_ptr, presence_ptr, frequency_ptr, repetition_ptr, counts_ptr, prompt_ptr, \
        prompt_stride = edits
    live = cols < vocab
    x = tl.load(row_ptr + cols, mask=live, other=float("-inf")).to(tl.float32)
    if PENALIZED:
        table_row = tl.load(rows_ptr + row).to(tl.int64)
        if table_row >= 0:
            count = tl.load(counts_ptr + table_row * vocab + cols, mask=live, other=0)
            words = tl.load(prompt_ptr + table_row * prompt_stride + cols // 32, mask=live, other=0)
            seen = (count > 0) | (((words >> (cols % 32)) & 1) != 0)
            repetition = tl.load(repetition_ptr + row)
            x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
            x = x - tl.load(frequency_ptr + row) * count.to(tl.float32) \
                - tl.load(presence_ptr + row) * (count > 0).to(tl.float32)
    if MASKED:
        words = tl.load(bitmask_ptr + row.to(tl.int64) * bitmask_stride + cols // 32, mask=live, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _record_draw(row, token, vocab, edits, PENALIZED: tl.constexpr):
    """Counts the row's drawn token in its table row, where it has one."""
    if PENALIZED:
        rows_ptr, counts_ptr = edits[2], edits[6]
        table_row = tl.load(rows_ptr + row).to(tl.int64)
        if table_row >= 0:
            count = tl.load(counts_ptr + table_row * vocab + token)
            tl.debug_barrier()  # every thread has read the count before any stores it: one increment
            tl.store(counts_ptr + table_row * vocab + token, count + 1)


@triton.jit
def _row_filters(row, vocab, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
                 HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """-> (T, k or 0 when off, top_p, min_p): what the row asks, read the same way everywhere."""
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    top_k = tl.cast(0, tl.int32)
    top_p = tl.cast(1.0, tl.float32)
    min_p = tl.cast(0.0, tl.float32)
    if HAS_TOP_K:
        top_k = tl.load(top_ks_ptr + row)  # checked before the cast: an int64 k past the vocabulary is off
        top_k = tl.where((top_k >= 1) & (top_k < vocab), top_k, 0).to(tl.int32)
    if HAS_TOP_P:
        top_p = tl.load(top_ps_ptr + row).to(tl.float32)
    if HAS_MIN_P:
        min_p = tl.load(min_ps_ptr + row).to(tl.float32)
    return temperature, top_k, top_p, min_p


@fast_launch
@triton.jit
def _scan_kernel(logits_ptr, row_stride, vocab, temperatures_ptr, seeds_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
                 bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                 counts_ptr, prompt_ptr, prompt_stride, best_ptr, index_ptr, max_ptr, sum_ptr, group_max_ptr,
                 num_groups, tile_key_ptr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                 HAS_MIN_P: tl.constexpr, MASKED: tl.constexpr, PENALIZED: tl.constexpr,
                 LOGPROBS: tl.constexpr, GROUPS: tl.constexpr, TILE: tl.constexpr, NOISE_BLOCK: tl.constexpr,
                 GROUP: tl.constexpr, ROUNDS: tl.constexpr, U_MAX: tl.constexpr, LOG2E: tl.constexpr,
                 PDL: tl.constexpr):
    """Loads its chunk as four [NOISE_BLOCK / GROUP, GROUP] blocks (one row of a block is one
    group); block i takes output i of the Philox calls at counters base + [0, NOISE_BLOCK)."""
    await_previous_kernel(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature, top_k, top_p, min_p = _row_filters(row, vocab, temperatures_ptr, top_ks_ptr, top_ps_ptr,
                                                    min_ps_ptr, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    filters = (top_k > 0) | (top_p < 1) | (min_p > 0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    base = chunk * 4 * NOISE_BLOCK
    within = tl.arange(0, NOISE_BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    cols0, cols1, cols2, cols3 = base + within, base + NOISE_BLOCK + within, base + 2 * NOISE_BLOCK + within, \
        base + 3 * NOISE_BLOCK + within
    edits = (bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr, counts_ptr,
             prompt_ptr, prompt_stride)
    x0 = _load_logits(row_ptr, cols0, vocab, row, edits, MASKED, PENALIZED)
    x1 = _load_logits(row_ptr, cols1, vocab, row, edits, MASKED, PENALIZED)
    x2 = _load_logits(row_ptr, cols2, vocab, row, edits, MASKED, PENALIZED)
    x3 = _load_logits(row_ptr, cols3, vocab, row, edits, MASKED, PENALIZED)
    g0, g1, g2, g3 = tl.max(x0, axis=1), tl.max(x1, axis=1), tl.max(x2, axis=1), tl.max(x3, axis=1)
    chunk_max = tl.max(tl.maximum(tl.maximum(g0, g1), tl.maximum(g2, g3)), axis=0)
    slot = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + slot, chunk_max)
    if GROUPS:
        groups = chunk * (4 * NOISE_BLOCK // GROUP) + tl.arange(0, NOISE_BLOCK // GROUP)
        group_row = group_max_ptr + row.to(tl.int64) * num_groups
        tl.store(group_row + groups, g0, mask=groups < num_groups)
        tl.store(group_row + groups + NOISE_BLOCK // GROUP, g1, mask=groups + NOISE_BLOCK // GROUP < num_groups)
        tl.store(group_row + groups + 2 * (NOISE_BLOCK // GROUP), g2,
                 mask=groups + 2 * (NOISE_BLOCK // GROUP) < num_groups)
        tl.store(group_row + groups + 3 * (NOISE_BLOCK // GROUP), g3,
                 mask=groups + 3 * (NOISE_BLOCK // GROUP) < num_groups)
        if TILE > 0:
            _tile_keys(g0, g1, g2, g3, chunk * (4 * NOISE_BLOCK // GROUP), num_groups,
                       tile_key_ptr + row.to(tl.int64) * tl.cdiv(num_groups, TILE), TILE)
    if LOGPROBS:
        # log-probabilities of greedy rows are those of the logits as they are (T = 1)
        scale = LOG2E / tl.where(temperature > 0, temperature, 1.0)
        shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
        total = tl.sum(tl.exp2((x0 - shift) * scale) + tl.exp2((x1 - shift) * scale)
                       + tl.exp2((x2 - shift) * scale) + tl.exp2((x3 - shift) * scale))
        tl.store(sum_ptr + slot, total)
    if (temperature > 0) & (filters == 0):
        seed = tl.load(seeds_ptr + row)
        scale = LOG2E / temperature
        u0, u1, u2, u3 = tl.rand4x(seed, cols0, ROUNDS)
        x0 = x0 * scale + _gumbel2(u0, U_MAX)
        x1 = x1 * scale + _gumbel2(u1, U_MAX)
        x2 = x2 * scale + _gumbel2(u2, U_MAX)
        x3 = x3 * scale + _gumbel2(u3, U_MAX)
    best, best_index = _keep_better(x0, cols0, x1, cols1)
    best, best_index = _keep_better(best, best_index, x2, cols2)
    best, best_index = _keep_better(best, best_index, x3, cols3)
    top = tl.max(tl.max(best, axis=1), axis=0)
    tl.store(best_ptr + slot, top)
    tl.store(index_ptr + slot, tl.min(tl.min(tl.where(best == top, best_index, vocab), axis=1), axis=0))


@triton.jit
def _tile_keys(g0, g1, g2, g3, first, num_groups, tile_row, TILE: tl.constexpr):
    """Stores the largest finalize key (_orderable) of every TILE groups of the chunk's four
    blocks of group maxima g0..g3 (groups first + [0, 4n)), keying groups past the row's
    count 0 as the finalize's select does. The four blocks join as the columns of one [n, 4]
    tensor, so that one cross-warp reduction serves them all."""
    n: tl.constexpr = g0.shape[0]
    groups = first + tl.arange(0, n)
    keys = tl.join(tl.join(_keys_of(g0, groups < num_groups), _keys_of(g2, groups + 2 * n < num_groups)),
                   tl.join(_keys_of(g1, groups + n < num_groups), _keys_of(g3, groups + 3 * n < num_groups)))
    keys = tl.max(tl.reshape(keys, [n // TILE, TILE, 4]), axis=1)
    tiles = first // TILE + tl.arange(0, 4)[None, :] * (n // TILE) + tl.arange(0, n // TILE)[:, None]
    tl.store(tile_row + tiles, keys.to(tl.int32, bitcast=True), mask=tiles * TILE < num_groups)


@triton.jit
def _keys_of(maxima, live):
    """Order-preserving uint32 keys of group maxima; 0, the lowest, where not live."""
    return tl.where(live, _orderable(maxima), 0)


@triton.jit
def _keep_better(best, best_index, x, cols):
    """Strictly better replaces: the first best token wins ties, as torch.argmax's does."""
    better = x > best
    return tl.where(better, x, best), tl.where(better, cols, best_index)


@triton.jit
def _min_p_noisy(row_ptr, cols, vocab, row, edits, row_max, temperature, floor, scale, u, U_MAX: tl.constexpr,
                 MASKED: tl.constexpr, PENALIZED: tl.constexpr):
    x = _load_logits(row_ptr, cols, vocab, row, edits, MASKED, PENALIZED)
    # the row's max is kept where p / p_max is NaN (a +inf max) and where every logit is -inf
    kept = (x == row_max) | (((x - row_max) / temperature >= floor) & (x > float("-inf")))
    return tl.where(kept, x * scale + _gumbel2(u, U_MAX), float("-inf"))


@fast_launch
@triton.jit
def _min_p_draw_kernel(logits_ptr, row_stride, vocab, temperatures_ptr, seeds_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
                       bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                       counts_ptr, prompt_ptr, prompt_stride, best_ptr, index_ptr, max_ptr, num_chunks,
                       HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, MASKED: tl.constexpr,
                       PENALIZED: tl.constexpr, CHUNKS: tl.constexpr,
                       NOISE_BLOCK: tl.constexpr, ROUNDS: tl.constexpr, U_MAX: tl.constexpr,
                       LOG2E: tl.constexpr, PDL: tl.constexpr):
    """The scan's draw again for rows whose only filter is min-p, now that their max is known."""
    await_previous_kernel(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature, top_k, top_p, min_p = _row_filters(row, vocab, temperatures_ptr, top_ks_ptr, top_ps_ptr,
                                                    min_ps_ptr, HAS_TOP_K, HAS_TOP_P, True)
    if (temperature > 0) & (min_p > 0) & (top_k == 0) & (top_p >= 1):
        chunks = tl.arange(0, CHUNKS)
        row_max = tl.max(tl.load(max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                                 other=float("-inf")), axis=0)
        floor = tl.log(min_p)
        seed = tl.load(seeds_ptr + row)
        scale = LOG2E / temperature
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        cols = chunk * 4 * NOISE_BLOCK + tl.arange(0, NOISE_BLOCK)
        edits = (bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                 counts_ptr, prompt_ptr, prompt_stride)
        u0, u1, u2, u3 = tl.rand4x(seed, cols, ROUNDS)
        x = _min_p_noisy(row_ptr, cols, vocab, row, edits, row_max, temperature, floor, scale, u0, U_MAX, MASKED,
                         PENALIZED)
        x1 = _min_p_noisy(row_ptr, cols + NOISE_BLOCK, vocab, row, edits, row_max, temperature, floor, scale, u1,
                          U_MAX, MASKED, PENALIZED)
        best, best_index = _keep_better(x, cols, x1, cols + NOISE_BLOCK)
        x2 = _min_p_noisy(row_ptr, cols + 2 * NOISE_BLOCK, vocab, row, edits, row_max, temperature, floor, scale, u2,
                          U_MAX, MASKED, PENALIZED)
        best, best_index = _keep_better(best, best_index, x2, cols + 2 * NOISE_BLOCK)
        x3 = _min_p_noisy(row_ptr, cols + 3 * NOISE_BLOCK, vocab, row, edits, row_max, temperature, floor, scale, u3,
                          U_MAX, MASKED, PENALIZED)
        best, best_index = _keep_better(best, best_index, x3, cols + 3 * NOISE_BLOCK)
        top = tl.max(best, axis=0)
        slot = row * num_chunks + chunk
        tl.store(best_ptr + slot, top)
        tl.store(index_ptr + slot, tl.min(tl.where(best == top, best_index, vocab), axis=0))


@triton.jit
def _orderable(x):
    """float32 -> uint32 whose unsigned order is the floats' order."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _unorder(key):
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split_at_kth(keys, live, k, DIGIT: tl.constexpr):
    """-> (above, level, need): masks of the live keys larger than their k-th largest and of
    those that may equal it, need of which complete the k largest (1 <= k <= live keys).
    Radix select, DIGIT bits a pass from the top: a histogram of the level keys' next digit
    gives the k-th largest one's; it stops once exactly the needed keys are level."""
    tl.static_assert(32 % DIGIT == 0)
    bins = tl.arange(0, 1 << DIGIT).to(tl.int64)
    above = tl.zeros(keys.shape, tl.int1)
    level = live
    need = k
    count = -1  # level keys, unknown before the first pass
    shift = 32
    while (shift > 0) & (count != need):
        shift -= DIGIT
        digits = ((keys >> shift.to(tl.uint32)) & ((1 << DIGIT) - 1)).to(tl.int32)
        counts = tl.histogram(digits, 1 << DIGIT, mask=level)
        at_least = tl.cumsum(counts, 0, reverse=True)
        here = (at_least >= need) & (at_least - counts < need)
        # one reduction: the k-th key's digit, how many level keys share it, how many pass it
        found = tl.sum(tl.where(here, bins << 32 | counts.to(tl.int64) << 16,
                                tl.where(at_least < need, counts, 0).to(tl.int64)), axis=0)
        digit = (found >> 32).to(tl.int32)
        above |= level & (digits > digit)
        level &= digits == digit
        count = ((found >> 16) & 0xFFFF).to(tl.int32)
        need -= (found & 0xFFFF).to(tl.int32)
    return above, level, need


@triton.jit
def _store_top(keys, live, values, k, out, DIGIT: tl.constexpr):
    """Writes to out, in tensor order, the values of the k live keys first by (key descending,
    position ascending)."""
    above, level, need = _split_at_kth(keys, live, k, DIGIT)
    _store_chosen(above, level, need, values, out)


@triton.jit
def _store_chosen(above, level, need, values, out):
    """Writes to out, in tensor order, the values above and the first need level ones."""
    # running counts of the keys above and level in one scan (each below 2**16)
    before = tl.cumsum(above.to(tl.int32) << 16 | level.to(tl.int32), axis=0)
    chosen = above | (level & ((before & 0xFFFF) <= need))
    tl.store(out + (before >> 16) + tl.minimum(before & 0xFFFF, need) - 1, values, mask=chosen)


@triton.jit
def _group_keys(group_row, gids, live):
    """_keys_of the row's group maxima gids."""
    return _keys_of(tl.load(group_row + gids, mask=live, other=0.0), live)


@triton.jit
def _top_groups(group_max_ptr, tile_key_ptr, row, num_groups, gid_row, k, GROUPS_PAD: tl.constexpr,
                K_PAD: tl.constexpr, TILE: tl.constexpr, DIGIT: tl.constexpr):
    """Writes to gid_row the ids, in increasing order, of the min(k, groups) groups first by
    (group max descending, id ascending): they hold the row's top k tokens, since groups are
    runs of consecutive ids. Padding ids (>= num_groups) rank below every group and fill the
    slots past num_groups. With TILE > 0 the groups are ranked only within the k tiles of TILE
    groups first by (tile key descending, id ascending), from the scan's tile keys: a group
    outside those has k tile maxima, so k groups, ahead of it."""
    top = tl.minimum(k, num_groups)
    if TILE > 0:
        tiles = tl.arange(0, GROUPS_PAD // TILE)
        live = tiles < tl.cdiv(num_groups, TILE)
        tile_row = tile_key_ptr + row.to(tl.int64) * tl.cdiv(num_groups, TILE)
        tile_keys = tl.load(tile_row + tiles, mask=live, other=0).to(tl.uint32, bitcast=True)
        _store_top(tile_keys, live, tiles, top, gid_row, DIGIT)
        tl.debug_barrier()  # the tile ids written above, read back by other threads
        spots = tl.arange(0, K_PAD * TILE)
        gids = tl.load(gid_row + spots // TILE, mask=spots // TILE < top, other=0) * TILE + spots % TILE
        live = (spots // TILE < top) & (gids < num_groups)
        tl.debug_barrier()  # every tile id read before the group ids overwrite them
    else:
        gids = tl.arange(0, GROUPS_PAD)
        live = gids < num_groups
    _store_top(_group_keys(group_max_ptr + row.to(tl.int64) * num_groups, gids, live), live, gids, top, gid_row,
               DIGIT)
    pads = tl.arange(0, K_PAD)
    tl.store(gid_row + pads, pads, mask=(pads >= num_groups) & (pads < tl.minimum(k, GROUPS_PAD)))
    return tl.minimum(k, GROUPS_PAD)


@triton.jit
def _ranked_tokens(row_ptr, vocab, row, edits, group_row, num_groups, gid_row, chosen, k, ranked_row,
                   K_PAD: tl.constexpr, GROUP: tl.constexpr, DIGIT: tl.constexpr, MASKED: tl.constexpr,
                   PENALIZED: tl.constexpr):
    """-> (x, ids) [K_PAD]: the top k tokens of the chosen groups by (logit desc, id asc) first,
    then other tokens of the groups or -inf. The chosen groups' maxima are k tokens at or above
    the least of them, so the top k tokens are among the tokens at or above it: when those are
    at least k and fit in K_PAD slots (unless many tie, nearly always), they alone are written
    out and sorted; otherwise a radix select of the chosen groups' tokens (ties by position:
    ids increase along the tile) writes exactly the top k, or all of them where fewer. Either
    way a sort of K_PAD keys ranks them, in place of a top-k over K_PAD * GROUP."""
    slots = tl.arange(0, K_PAD)
    live_slots = slots < chosen
    gids = tl.load(gid_row + slots, mask=live_slots, other=0)
    # the least chosen group maximum (padding groups: -inf, as their tokens)
    floor = tl.min(tl.where(live_slots, _orderable(tl.load(group_row + gids, mask=live_slots & (gids < num_groups),
                                                                   other=float("-inf"))), 0xFFFFFFFF), axis=0)
    ids = gids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    # dead slots read group 0's tokens (in bounds) and drop them after: a where on the addresses fails to
    # compile (MLIR dominance) at K_PAD 1024 in Triton 3.6
    x = tl.where(live_slots[:, None], _load_logits(row_ptr, ids, vocab, row, edits, MASKED, PENALIZED), float("-inf"))
    live = tl.reshape(tl.broadcast_to(live_slots[:, None], [K_PAD, GROUP]), [K_PAD * GROUP])
    keys = tl.where(live, tl.reshape(_orderable(x), [K_PAD * GROUP]), 0)
    # rank by (logit desc, id asc): one uint64 key, the id's complement below the logit's
    ids = tl.reshape(ids, [K_PAD * GROUP])
    ranking = keys.to(tl.uint64) << 32 | (ids.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
    above = live & (keys >= floor)
    count = tl.sum(above.to(tl.int32), axis=0)
    if (count >= k) & (count <= K_PAD):
        _store_chosen(above, tl.zeros_like(above), 0, ranking, ranked_row)
    else:
        count = tl.minimum(k, chosen * GROUP)  # all the groups' tokens where those are fewer than k
        _store_top(keys, live, ranking, count, ranked_row, DIGIT)
    tl.debug_barrier()  # the keys written above, read back by other threads
    # empty slots: -inf, below every token
    ranked = tl.load(ranked_row + slots, mask=slots < count, other=0x7FFFFF << 32).to(tl.uint64, bitcast=True)
    ranked = tl.sort(ranked, descending=True)
    return _unorder((ranked >> 32).to(tl.uint32)), ((ranked & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)


@fast_launch
@triton.jit
def _finalize_kernel(logits_ptr, row_stride, vocab, temperatures_ptr, seeds_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
                     bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                     counts_ptr, prompt_ptr, prompt_stride, best_ptr, index_ptr, max_ptr, sum_ptr, num_chunks,
                     group_max_ptr, num_groups, tile_key_ptr, gid_ptr, ranked_ptr, tokens_ptr, logprobs_ptr,
                     HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                     MASKED: tl.constexpr, PENALIZED: tl.constexpr,
                     LOGPROBS: tl.constexpr, GROUPS: tl.constexpr, CHUNKS: tl.constexpr,
                     GROUPS_PAD: tl.constexpr, K_PAD: tl.constexpr, TILE: tl.constexpr, DIGIT: tl.constexpr,
                     GROUP: tl.constexpr, NOISE_BLOCK: tl.constexpr,
                     ROUNDS: tl.constexpr, U_MAX: tl.constexpr, LOG2E: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    row = tl.program_id(0)
    temperature, top_k, top_p, min_p = _row_filters(row, vocab, temperatures_ptr, top_ks_ptr, top_ps_ptr,
                                                    min_ps_ptr, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    edits = (bitmask_ptr, bitmask_stride, penalty_rows_ptr, presence_ptr, frequency_ptr, repetition_ptr, counts_ptr,
             prompt_ptr, prompt_stride)
    chunks = tl.arange(0, CHUNKS)
    # the first best chunk: its index is that chunk's first best token
    best = tl.load(best_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"))
    first = tl.min(tl.where(best == tl.max(best, axis=0), chunks, CHUNKS), axis=0)
    token = tl.load(index_ptr + row * num_chunks + first)
    if GROUPS:
        if (temperature > 0) & ((top_k > 0) | (top_p < 1)):
            k = tl.where(top_k > 0, tl.minimum(top_k, K_PAD), K_PAD)
            gid_row = gid_ptr + row * K_PAD
            chosen = _top_groups(group_max_ptr, tile_key_ptr, row, num_groups, gid_row, k, GROUPS_PAD, K_PAD, TILE,
                                 DIGIT)
            tl.debug_barrier()  # the group ids written above, read back by other threads
            slots = tl.arange(0, K_PAD)
            x, ids = _ranked_tokens(row_ptr, vocab, row, edits, group_max_ptr + row.to(tl.int64) * num_groups,
                                    num_groups, gid_row, chosen, k, ranked_ptr + row * K_PAD, K_PAD, GROUP, DIGIT,
                                    MASKED, PENALIZED)
            z = (x - tl.max(x, axis=0)) / temperature  # log(p / p_max)
            keep = (slots < k) & (x > float("-inf"))
            if HAS_MIN_P:
                keep &= z >= tl.log(min_p)
            if HAS_TOP_P:
                mass = tl.where(keep, tl.exp(z), 0.0)
                before = tl.cumsum(mass, axis=0) - mass
                keep &= before < tl.where(top_p < 1, top_p * tl.sum(mass, axis=0), float("inf"))
            # the first rank always survives: a top_p that float32 rounds to 0 or a +inf logit (z NaN) would keep none
            keep |= slots == 0
            seed = tl.load(seeds_ptr + row)
            noisy = tl.where(keep, x * (LOG2E / temperature) + _token_noise(seed, ids, NOISE_BLOCK, ROUNDS, U_MAX),
                             float("-inf"))
            pick = tl.min(tl.where(noisy == tl.max(noisy, axis=0), slots, K_PAD), axis=0)
            token = tl.sum(tl.where(slots == pick, ids, 0), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    if LOGPROBS:
        t = tl.where(temperature > 0, temperature, 1.0)
        maxima = tl.load(max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"))
        row_max = tl.max(maxima, axis=0)
        sums = tl.load(sum_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0)
        weights = tl.where(maxima > float("-inf"), tl.exp2((maxima - row_max) * (LOG2E / t)), 0.0)
        chosen_logit = _load_logits(row_ptr, token, vocab, row, edits, MASKED, PENALIZED)
        tl.store(logprobs_ptr + row, (chosen_logit - row_max) / t - tl.log(tl.sum(sums * weights, axis=0)))
    tl.debug_barrier()  # the chosen token's count read above before it changes
    _record_draw(row, token, vocab, edits, PENALIZED)


class SampleLaunches:
    """The three launches on one row-major [rows, vocab] logits tensor; the CUDA C++ sampler
    fills the same buffers (kernels/cuda/sampling.py) and takes no `edits` (token bitmask,
    penalties): dispatch.py routes calls with them here."""

    def scan(self, logits, temperatures, seeds, filters, buffers, logprobs: bool, groups: bool, **edits):
        rows, vocab = logits.shape
        _scan_kernel[(rows, buffers["chunks"])](
            logits, logits.stride(0), vocab, temperatures, seeds, *filters, *_edit_args(**edits), buffers["best"],
            buffers["index"], buffers["max"], buffers["sum"], buffers["group_max"], buffers["groups"],
            buffers["tile_keys"], **_has(filters), **_edited(**edits), LOGPROBS=logprobs, GROUPS=groups,
            TILE=buffers["tile"], NOISE_BLOCK=noise_block(vocab), GROUP=GROUP, ROUNDS=PHILOX_ROUNDS, U_MAX=U_MAX,
            LOG2E=LOG2E, num_warps=8, **dependent_launch(logits.get_device()))

    def min_p_draw(self, logits, temperatures, seeds, filters, buffers, **edits):
        rows, vocab = logits.shape
        has = _has(filters)
        _min_p_draw_kernel[(rows, buffers["chunks"])](
            logits, logits.stride(0), vocab, temperatures, seeds, *filters, *_edit_args(**edits), buffers["best"],
            buffers["index"], buffers["max"], buffers["chunks"], HAS_TOP_K=has["HAS_TOP_K"],
            HAS_TOP_P=has["HAS_TOP_P"], **_edited(**edits), CHUNKS=next_power_of_2(buffers["chunks"]),
            NOISE_BLOCK=noise_block(vocab), ROUNDS=PHILOX_ROUNDS, U_MAX=U_MAX, LOG2E=LOG2E, num_warps=8,
            **dependent_launch(logits.get_device()))

    def finalize(self, logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad: int, **edits):
        """logprobs: a float32 [rows] output, or None."""
        rows, vocab = logits.shape
        groups, k_pad = k_pad > 0, max(k_pad, 1)
        _finalize_kernel[(rows,)](
            logits, logits.stride(0), vocab, temperatures, seeds, *filters, *_edit_args(**edits), buffers["best"],
            buffers["index"], buffers["max"], buffers["sum"], buffers["chunks"], buffers["group_max"],
            buffers["groups"], buffers["tile_keys"], buffers["gids"], buffers["ranked"], tokens, logprobs,
            **_has(filters), **_edited(**edits), LOGPROBS=logprobs is not None, GROUPS=groups,
            CHUNKS=next_power_of_2(buffers["chunks"]), GROUPS_PAD=next_power_of_2(buffers["groups"]), K_PAD=k_pad,
            TILE=buffers["tile"], DIGIT=RADIX_BITS, GROUP=GROUP, NOISE_BLOCK=noise_block(vocab),
            ROUNDS=PHILOX_ROUNDS, U_MAX=U_MAX, LOG2E=LOG2E, num_warps=8 if groups else 4,
            **dependent_launch(logits.get_device()))


def noise_block(vocab: int) -> int:
    return min(NOISE_BLOCK, max(GROUP, next_power_of_2(cdiv(vocab, 4))))


def _edit_args(token_bitmask=None, penalties=None) -> tuple:
    """The kernels' bitmask (pointer, row stride) and penalty (rows, presence, frequency,
    repetition, counts, prompt, prompt's row stride) arguments; None and 0 for those not given."""
    bitmask = (None, 0) if token_bitmask is None else (token_bitmask, token_bitmask.stride(0))
    if penalties is None:
        return (*bitmask, None, None, None, None, None, None, 0)
    p = penalties
    return (*bitmask, p.rows, p.presence, p.frequency, p.repetition, p.counts, p.prompt, p.prompt.stride(0))


def _edited(token_bitmask=None, penalties=None) -> dict:
    return dict(MASKED=token_bitmask is not None, PENALIZED=penalties is not None)


def _has(filters) -> dict:
    top_ks, top_ps, min_ps = filters
    return dict(HAS_TOP_K=top_ks is not None, HAS_TOP_P=top_ps is not None, HAS_MIN_P=min_ps is not None)


def sample(logits, temperatures, seeds, top_ks=None, top_ps=None, min_ps=None, max_top_k=None, logprobs=False,
           launches: SampleLaunches = SampleLaunches(), token_bitmask=None, penalties=None):
    """See kernels.sample. Every launch applies the penalties and the token bitmask where it
    loads logits; the finalize counts the drawn tokens of penalized rows."""
    filtering = top_ks is not None or top_ps is not None
    bound = logits.shape[1] if max_top_k is None else max_top_k
    if filtering and bound > SORT_FREE_TOP_K:
        return _sample_sorted(logits, temperatures, seeds, top_ks, top_ps, min_ps, logprobs, launches, token_bitmask,
                              penalties)
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, vocab = rows.shape
    k_pad = next_power_of_2(max(bound, 2)) if filtering else 0  # >= 2: the smallest the sort is tested at on GPUs
    buffers = _buffers(num_rows, vocab, k_pad, rows.device)
    filters = (top_ks, top_ps, min_ps)
    edits = {}  # only those given: the CUDA C++ launches take none
    if token_bitmask is not None:
        edits["token_bitmask"] = token_bitmask.contiguous()
    if penalties is not None:
        edits["penalties"] = penalties
    launches.scan(rows, temperatures, seeds, filters, buffers, logprobs, groups=filtering, **edits)
    if min_ps is not None:
        launches.min_p_draw(rows, temperatures, seeds, filters, buffers, **edits)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=rows.device)
    chosen = torch.empty(num_rows, dtype=torch.float32, device=rows.device) if logprobs else None
    launches.finalize(rows, temperatures, seeds, filters, buffers, tokens, chosen, k_pad, **edits)
    return tokens, chosen


def _buffers(num_rows: int, vocab: int, k_pad: int, device) -> dict:
    chunks = cdiv(vocab, 4 * noise_block(vocab))
    groups = cdiv(vocab, GROUP) if k_pad else 1
    # past SELECT groups the scan also keeps tiles' maxima: at most SELECT groups in the k best
    # tiles, and a tile within one of its NOISE_BLOCK-token blocks
    tile = min(SELECT // k_pad, noise_block(vocab) // GROUP) if groups > SELECT else 0
    empty = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    return dict(chunks=chunks, groups=groups, best=empty(num_rows, chunks), index=empty(num_rows, chunks, dtype=torch.int32),
                max=empty(num_rows, chunks), sum=empty(num_rows, chunks), group_max=empty(num_rows, groups),
                tile=tile, tile_keys=empty(num_rows, cdiv(groups, tile) if tile else 1, dtype=torch.int32),
                gids=empty(num_rows, max(k_pad, 1), dtype=torch.int32),
                ranked=empty(num_rows, max(k_pad, 1), dtype=torch.int64))


def _sample_sorted(logits, temperatures, seeds, top_ks, top_ps, min_ps, logprobs, launches, token_bitmask, penalties):
    """Rows may keep more tokens than the sort-free path holds: filter through a sort, then draw
    without filters (greedy rows keep every token, so they still take the argmax)."""
    if token_bitmask is not None or penalties is not None:
        logits = reference.apply_token_bitmask(penalty_ops.apply(logits.float(), penalties), token_bitmask)
    keep = reference.sampling_mask(logits, temperatures, top_ks, top_ps, min_ps)
    tokens, _ = sample(logits.float().masked_fill(~keep, float("-inf")), temperatures, seeds, launches=launches)
    penalty_ops.record(penalties, tokens)
    if not logprobs:
        return tokens, None
    scale = torch.where(temperatures > 0, temperatures, 1).float()[:, None]
    return tokens, (logits.float() / scale).log_softmax(dim=-1).gather(1, tokens[:, None]).view(-1)


def max_top_k_variants() -> list[int]:
    """A max_top_k for each variant of the kernels that sample() launches with top_ks /
    top_ps: the largest bound of each k_pad of the sort-free path, then one past
    SORT_FREE_TOP_K (filtered through a sort, then drawn by the unfiltered kernels on float32
    logits). Launching each compiles them all ahead of use."""
    k_pads = {next_power_of_2(max(bound, 2)): bound for bound in range(1, SORT_FREE_TOP_K + 1)}
    return sorted(k_pads.values()) + [SORT_FREE_TOP_K + 1]
