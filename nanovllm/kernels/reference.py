"""PyTorch reference implementations of every kernel: the fallback when Triton cannot run,
and the definition the Triton kernels are tested against. Arithmetic is done in fp32 (or
float64 when the input is float64) and the result is cast back to the input's dtype."""

import torch
import torch.nn.functional as F

from nanovllm.kernels import penalties as penalty_ops


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.to(_compute_dtype(x)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    gate, up = x.to(_compute_dtype(x)).chunk(2, dim=-1)
    return (_gelu(gate, approximate) * up).to(x.dtype)


def fused_add_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    dtype = _compute_dtype(x)
    return _gelu(x.to(dtype) + bias.to(dtype), approximate).to(x.dtype)


def element_wise_mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(a)
    return (a.to(dtype) * b.to(dtype) + c.to(dtype)).to(a.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = _compute_dtype(x)
    xf = x.to(dtype)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(dtype)).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    summed = (x.to(_compute_dtype(x)) + residual.to(_compute_dtype(x))).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """`prefetch` is a cache hint: nothing to do here."""
    dtype = _compute_dtype(x)
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).to(x.dtype)


def norm_linear(x, residual, norm_weight, eps, weight, bias=None, prefetch=None, leave_room=False, activation=None):
    """`prefetch` and `leave_room` are hints to the GPU's scheduling: nothing to do here."""
    normed, residual = (rms_norm(x, norm_weight, eps), x) if residual is None else fused_add_rms_norm(
        x, residual, norm_weight, eps)
    if activation is None:
        return small_batch_linear(normed, weight, bias), residual
    return linear_act(normed, weight, bias, None, activation), residual


def embed_norm_linear(input_ids, embed_weight, embed_scale, norm_weight, eps, weight, bias=None, leave_room=False):
    embedded = F.embedding(input_ids, embed_weight)
    if embed_scale is not None:
        embedded = (embedded.to(_compute_dtype(embedded)) * embed_scale).to(embedded.dtype)
    return norm_linear(embedded, None, norm_weight, eps, weight, bias)


def _gated(x, activation):
    return silu_and_mul(x) if activation == "silu" else gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none")


def linear_act(x, weight, bias=None, prefetch=None, activation="silu"):
    return _gated(small_batch_linear(x, weight, bias), activation)


def act_linear(x, weight, bias=None, prefetch=None, activation="silu"):
    return small_batch_linear(_gated(x, activation), weight, bias)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """Per-element multipliers of an FP8 weight: scale [N, 1] per output row, or one per
    block[0] x block[1] tile."""
    if block is None:
        return scale
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (weight.float() * _expand_scales(scale, weight.shape, block)).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 dequant multipliers): each output row's, or each block's, largest
    magnitude maps to FP8_MAX."""
    w = weight.float()
    if block is None:
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        rows, cols = w.shape
        padded = F.pad(w.abs(), (0, -cols % block[1], 0, -rows % block[0]))
        amax = padded.unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0])).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (w / _expand_scales(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Where FP8 matmuls do not run: the weight dequantized to x's dtype, activations as they are."""
    return F.linear(x, dequantize_fp8(weight, scale, block, x.dtype), bias)


def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    # index_select rather than advanced indexing: the latter is far slower on the CPU.
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x1, x2 = x.to(dtype).chunk(2, dim=-1)
        c, s = cos.to(dtype), sin.to(dtype)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def allowed_tokens(token_bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool from an int32 [B, ceil(vocab / 32)] bitmask: token v is allowed where bit
    v % 32 of word v // 32 is set (xgrammar's and llguidance's layout)."""
    bits = torch.arange(32, dtype=torch.int32, device=token_bitmask.device)
    return ((token_bitmask.int()[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor | None) -> torch.Tensor:
    """The logits with the tokens the bitmask disallows at -inf (a new tensor; `logits` as it is without one)."""
    if token_bitmask is None:
        return logits
    return logits.masked_fill(~allowed_tokens(token_bitmask, logits.shape[1]), float("-inf"))


def sampling_mask(logits: torch.Tensor, temperatures: torch.Tensor, top_ks=None, top_ps=None, min_ps=None):
    """[B, V] bool: the tokens each row may draw. Tokens rank by logit, ties by token id (lower
    first). min-p keeps tokens with p >= min_p * p_max under softmax(logits / T); top-k keeps the
    first k ranks (k outside [1, V) keeps all); top-p then keeps the ranks, among those left,
    before which less than top_p of their renormalised mass lies (top_p >= 1 keeps all). The
    first rank is always kept. Greedy rows (T = 0) keep everything."""
    x = logits.to(_compute_dtype(logits))
    values, order = x.sort(dim=-1, descending=True, stable=True)
    greedy = temperatures <= 0
    scale = torch.where(greedy, 1, temperatures).to(x.dtype)[:, None]
    z = (values - values[:, :1]) / scale  # log(p / p_max)
    keep = values > float("-inf")
    if top_ks is not None:
        k = top_ks[:, None].long()
        keep &= (torch.arange(x.shape[1], device=x.device)[None, :] < k) | (k < 1) | (k >= x.shape[1])
    if min_ps is not None:
        keep &= z >= min_ps.to(x.dtype)[:, None].log()
    if top_ps is not None:
        mass = torch.where(keep, z.exp(), 0)
        before = mass.cumsum(dim=-1) - mass
        p = top_ps.to(x.dtype)[:, None]
        keep &= (before < p * mass.sum(dim=-1, keepdim=True)) | (p >= 1)
    # a top_p that float32 rounds to 0, or a +inf logit (p / p_max is NaN), would keep nothing
    keep[:, 0] = True
    keep |= greedy[:, None]
    return torch.empty_like(keep).scatter_(1, order, keep)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, top_ks=None, top_ps=None,
           min_ps=None, max_top_k=None, logprobs: bool = False, token_bitmask=None, penalties=None):
    """argmax(logits / T + Gumbel noise) over the tokens sampling_mask keeps, the noise of row i
    drawn from a generator seeded with seeds[i]; argmax(logits) where T == 0. With `logprobs`,
    also log_softmax(logits / T)[token] (T = 1 for greedy rows). The logits are penalized first,
    and tokens the bitmask disallows are -inf; the drawn tokens of penalized rows are counted.
    Same distribution as the kernels; the random streams differ. max_top_k only steers the
    kernels."""
    dtype = _compute_dtype(logits)
    x = apply_token_bitmask(penalty_ops.apply(logits.to(dtype), penalties), token_bitmask)
    tokens = x.argmax(dim=-1)
    sampled = temperatures > 0
    scale = torch.where(sampled, temperatures, 1).to(dtype)[:, None]
    rows = sampled.nonzero().flatten()
    if rows.numel():
        tempered = x[rows] / scale[rows]
        if top_ks is not None or top_ps is not None or min_ps is not None:
            pick = (lambda t: None if t is None else t[rows])
            keep = sampling_mask(x[rows], temperatures[rows], pick(top_ks), pick(top_ps), pick(min_ps))
            tempered = tempered.masked_fill(~keep, float("-inf"))
        uniforms = torch.stack([
            torch.rand(x.shape[1], generator=torch.Generator(device=x.device).manual_seed(seed),
                       device=x.device, dtype=dtype) for seed in seeds[rows].tolist()])
        # -log(-log(u)), in place; u below 1 by half an ulp so that no noise is +inf
        gumbel = uniforms.clamp_(max=1 - torch.finfo(dtype).eps / 2).log_().neg_().log_().neg_()
        tokens[rows] = (tempered + gumbel).argmax(dim=-1)
    penalty_ops.record(penalties, tokens)
    if not logprobs:
        return tokens, None
    chosen = (x / scale).log_softmax(dim=-1).gather(1, tokens[:, None]).view(-1)
    return tokens, chosen.float()


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def to_cache(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it: a float8 cache x times 1 / scale in fp32,
    saturated to the largest finite e4m3 value (which has no infinity)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    fp8_max = torch.finfo(cache_dtype).max
    return (x.to(torch.float32) * (1.0 / scale)).clamp_(-fp8_max, fp8_max).to(cache_dtype)


def from_cache(entries: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as `dtype` values: a float8 cache's times its scale. The upcast comes
    first, as the CPU has no float8 arithmetic."""
    values = entries.to(dtype)
    return values.mul_(scale) if is_fp8(entries) and scale != 1.0 else values


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    valid = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping.index_select(0, valid).long()
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        entries = to_cache(new.index_select(0, valid), scale, cache.dtype)
        if is_fp8(cache):  # the CPU's index_copy_ takes no float8: copy the bytes
            cache, entries = cache.view(torch.uint8), entries.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, entries)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, first: int, seq_len: int, scale: float,
               dtype: torch.dtype) -> torch.Tensor:
    """Keys first..seq_len-1 of a sequence as `dtype` values; blocks wholly before `first`
    are not read."""
    block_size = cache.shape[1]
    first_block, num_blocks = first // block_size, -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[first_block:num_blocks].long())  # [n, block_size, Hk, D]
    keys = blocks.flatten(0, 1)[first - first_block * block_size:seq_len - first_block * block_size]
    return from_cache(keys, scale, dtype)


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight=None, k_weight=None, eps: float = 1e-6, *, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """The unfused composition: q/k norm, rotary, KV store; q rewritten in place."""
    if q_weight is not None:
        q_normed, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    else:
        q_normed = q
    q_rotated, k = apply_rotary_emb(positions, q_normed, k, cos_sin_cache)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q.copy_(q_rotated)


def paged_attention(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal=True,
                    sliding_window=None, k_scale=1.0, v_scale=1.0):
    """Per-sequence gather of the cached K/V, then attention in fp32 (float64 for float64
    inputs). A sequence whose query sees no key (seq_len 0) gets zeros. With a sliding window
    (causal only), a query sees the `sliding_window` keys ending at its own position. Float8
    caches are upcast and scaled (from_cache) before any arithmetic."""
    if q.shape[0] == seq_lens.shape[0] and max_seqlen_q == 1 and _padding_is_cheap(seq_lens, block_tables, k_cache):
        return _decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, sliding_window, k_scale,
                                 v_scale)
    out = torch.zeros_like(q)
    dtype = _compute_dtype(q)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        if seq_len == 0 or q_end == q_start:
            continue
        query_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        # the first key the first query sees; the window of later queries starts later still
        first = max(seq_len - (q_end - q_start) - sliding_window + 1, 0) if sliding_window else 0
        # [heads, tokens, head_dim], the layout scaled_dot_product_attention takes
        k = _gather_kv(k_cache, block_tables[i], first, seq_len, k_scale, dtype).transpose(0, 1)
        v = _gather_kv(v_cache, block_tables[i], first, seq_len, v_scale, dtype).transpose(0, 1)
        qs = q[q_start:q_end].to(dtype).transpose(0, 1)
        mask = None
        if causal:
            key_pos = torch.arange(first, seq_len, device=q.device)[None, :]
            mask = key_pos <= query_pos[:, None]
            if sliding_window:
                mask &= key_pos > query_pos[:, None] - sliding_window
        attended = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = attended.transpose(0, 1).to(q.dtype)
    return out


def qk_norm_rope_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, cu_seqlens_q,
                           seq_lens, block_tables, max_seqlen_q, scale, sliding_window=None, q_weight=None,
                           k_weight=None, eps=1e-6, k_scale=1.0, v_scale=1.0):
    """The unfused composition: qk_norm_rope_store, then causal paged_attention."""
    q = qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight,
                           eps, k_scale=k_scale, v_scale=v_scale)
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                           block_tables=block_tables, max_seqlen_q=max_seqlen_q, scale=scale,
                           sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)


def _padding_is_cheap(seq_lens, block_tables, k_cache) -> bool:
    """The batched decode path gathers every sequence to the widest block table: worth it
    while that at most quadruples the keys read and the gathered copy stays small."""
    padded_keys = block_tables.numel() * k_cache.shape[1]
    gathered_elements = padded_keys * k_cache.shape[2] * k_cache.shape[3]
    return padded_keys <= 4 * int(seq_lens.sum()) + k_cache.shape[1] * seq_lens.shape[0] and gathered_elements <= 1 << 28


def _decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, sliding_window=None, k_scale=1.0,
                      v_scale=1.0):
    """Every sequence has exactly one query row (a decode step): one batched attention over
    caches gathered to the widest block table, instead of a Python loop over sequences."""
    dtype = _compute_dtype(q)
    num_seqs, width = block_tables.shape
    block_size = k_cache.shape[1]
    blocks = block_tables.clamp_min(0).flatten().long()  # padding entries are masked below

    key_pos = torch.arange(width * block_size, device=q.device)[None, :]
    visible = key_pos < seq_lens[:, None]
    if sliding_window:
        visible &= key_pos >= seq_lens[:, None] - sliding_window
    # Slots past a sequence's end may hold anything (NaN too): masking scores is not enough.
    # index_fill_ of those rows: a few times cheaper on the CPU than a broadcast masked_fill.
    invisible = (~visible).flatten().nonzero().flatten()

    def gather(cache: torch.Tensor, cache_scale: float) -> torch.Tensor:  # -> [seqs, kv_heads, keys, head_dim]
        rows = from_cache(cache.index_select(0, blocks).view(num_seqs * width * block_size, -1), cache_scale, dtype)
        rows.index_fill_(0, invisible, 0)
        return rows.view(num_seqs, width * block_size, *cache.shape[2:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(q.to(dtype)[:, :, None], gather(k_cache, k_scale), gather(v_cache, v_scale),
                                         attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0].masked_fill((seq_lens == 0)[:, None, None], 0).to(q.dtype)


def stage_inputs(slots, parity, samples, token_rows, seq_rows, block_tables, num_tokens, num_seqs) -> None:
    slot = slots[int(parity)].to(token_rows.device, torch.int64)
    table_rows, width = int(slot[0]), max(int(slot[1]), 1)
    tokens_end = 2 + 3 * num_tokens
    seqs_end = tokens_end + 4 * (num_seqs + 1)
    tokens = slot[2:tokens_end].view(3, num_tokens).clone()
    deferred = tokens[0] < 0
    tokens[0] = torch.where(deferred, samples[torch.where(deferred, -1 - tokens[0], 0)], tokens[0])
    token_rows[:, :num_tokens] = tokens
    seq_rows[:, :num_seqs + 1] = slot[tokens_end:seqs_end].view(4, num_seqs + 1)
    block_tables[:table_rows, :width] = slot[seqs_end:seqs_end + table_rows * width].view(table_rows, width)
    parity.copy_(1 - parity)


def publish_tokens(tokens, last, host_slots, parity) -> None:
    last[:tokens.shape[0]] = tokens
    host_slots[int(parity), :tokens.shape[0]] = tokens
    parity.copy_(1 - parity)


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over the experts, the top_k largest (of equal probabilities the lowest expert id
    first: a stable sort), divided by their sum with `renormalize`. -> (float32 weights, int32
    ids), [tokens, top_k] each."""
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.promote_types(weights.dtype, torch.float32)), ids.to(torch.int32)


def max_row_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most block_m-row blocks num_slots (token, k) slots can fill, each expert's run padded
    on its own: every block holds a slot, and at most one block an expert is partly padding."""
    return min(num_slots, (num_slots + num_experts * (block_m - 1)) // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The (token, k) slots (flat index into topk_ids) sorted by expert, slot order kept within
    an expert, each expert's run padded with topk_ids.numel() to a multiple of block_m, in a
    buffer of the worst case's max_row_blocks blocks; and the expert of each block (-1 past
    the last run)."""
    slots = topk_ids.numel()
    blocks = max(max_row_blocks(slots, num_experts, block_m), 1)
    sorted_slots = torch.full((blocks * block_m,), slots, dtype=torch.int32, device=topk_ids.device)
    block_experts = torch.full((blocks,), -1, dtype=torch.int32, device=topk_ids.device)
    flat, row = topk_ids.reshape(-1), 0
    for expert in range(num_experts):
        mine = (flat == expert).nonzero().flatten()
        run = -(-mine.numel() // block_m)
        sorted_slots[row:row + mine.numel()] = mine.to(torch.int32)
        block_experts[row // block_m:row // block_m + run] = expert
        row += run * block_m
    return sorted_slots, block_experts


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ act_and_mul(w13[e] @ x[t]) for e = topk_ids[t, j],
    expert by expert over the experts that got tokens."""
    dtype = _compute_dtype(x)
    xc, out = x.to(dtype), torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, which = (topk_ids == expert).nonzero(as_tuple=True)
        activated = _gated(F.linear(xc[tokens], w13[expert].to(dtype)), activation)
        down = F.linear(activated, w2[expert].to(dtype)) * topk_weights[tokens, which, None].to(dtype)
        out.index_add_(0, tokens, down)
    return out.to(x.dtype)
