"""The public element-wise, norm, rotary, KV-cache, attention and sampling ops: each checks its
arguments, then runs what `dispatch` routed it to."""
import torch

from nanovllm.kernels.checks import (require, require_approximate, require_caches, require_cos_sin_cache,
                                     require_float, require_gated, require_index, require_last_dim_vector,
                                     require_like, require_paged_attention, require_qk_norm_rope_store,
                                     require_row_vector)
from nanovllm.kernels.dispatch import implementation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[..., 2d] -> silu(x[..., :d]) * x[..., d:]"""
    require_gated(x)
    return implementation("silu_and_mul", x.device)(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """x[..., 2d] -> gelu(x[..., :d]) * x[..., d:]"""
    require_gated(x)
    require_approximate(approximate)
    return implementation("gelu_and_mul", x.device)(x, approximate)


def fused_add_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias), bias of shape [x.shape[-1]]."""
    require_last_dim_vector(x, bias, "bias")
    require_approximate(approximate)
    return implementation("fused_add_gelu", x.device)(x, bias, approximate)


def element_wise_mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c, all of one shape and dtype."""
    require_float(a, "a")
    require_like(b, a, "b", "a")
    require_like(c, a, "c", "a")
    return implementation("element_wise_mul_add", a.device)(a, b, c)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in x's dtype; weight is
    x's dtype or float32."""
    require_last_dim_vector(x, weight, "weight")
    return implementation("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual). May reuse the memory of x and residual:
    callers must not read either afterwards."""
    require_last_dim_vector(x, weight, "weight")
    require_like(residual, x, "residual", "x")
    return implementation("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox-style rotary embedding. q [T, Hq, D], k [T, Hk, D], positions [T],
    cos_sin_cache [max_position, D] holding cos in its first half and sin in its second.
    Returns (q, k) rotated; may rotate them in place."""
    require_index(positions, "positions", 1)
    require_float(q, "q")
    require_float(k, "k")
    require(q.dim() == 3, "q", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    require(k.dim() == 3, "k", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(k.shape)}")
    require(q.shape[0] == positions.shape[0], "q", "token count differs from positions'")
    require(k.shape[0] == positions.shape[0], "k", "token count differs from positions'")
    require(k.shape[2] == q.shape[2] and q.shape[2] % 2 == 0, "k", "head_dim must be even and equal q's")
    require(k.dtype == q.dtype, "k", lambda: f"dtype {k.dtype} differs from q's {q.dtype}")
    require_cos_sin_cache(cos_sin_cache, q.shape[2])
    return implementation("apply_rotary_emb", q.device)(positions, q, k, cos_sin_cache)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes key/value [T, Hk, D] into the paged caches at slot_mapping[T]
    (slot = block * block_size + offset); slot -1 is skipped. A float8 cache stores
    key / k_scale and value / v_scale, saturated to its largest finite value."""
    require_caches(k_cache, v_cache, k_scale, v_scale)
    require_float(key, "key")
    require_like(value, key, "value", "key")
    require(key.dim() == 3 and key.shape[1:] == k_cache.shape[2:], "key",
            lambda: f"shape {tuple(key.shape)} must be [tokens, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    require_index(slot_mapping, "slot_mapping", 1)
    require(slot_mapping.shape[0] == key.shape[0], "slot_mapping", "length differs from key's token count")
    implementation("store_kvcache", key.device)(key, value, k_cache, v_cache, slot_mapping, float(k_scale),
                                                float(v_scale))


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight=None, k_weight=None, eps: float = 1e-6, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """What lies between the qkv projection and attention, in one launch: with q_weight and
    k_weight, rms_norm of each q and k head (Qwen3); apply_rotary_emb of q and k; k and v
    written to the paged caches at slot_mapping (-1 skipped), scaled as store_kvcache does.
    q [T, Hq, D] is rewritten in place and returned; k and v [T, Hk, D] are left as they
    are. The caches need unit stride along head_dim."""
    require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight,
                               k_scale, v_scale)
    return implementation("qk_norm_rope_store", q.device)(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                                          slot_mapping, q_weight, k_weight, float(eps),
                                                          k_scale=float(k_scale), v_scale=float(v_scale))


def paged_attention(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal=True,
                    sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """Attention of packed queries q [T, Hq, D] over the paged caches. Sequence i owns query rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys 0..seq_lens[i]-1 (cached + new) through
    block_tables[i]; with `causal`, query row j of a sequence of Lq rows (at position
    p = seq_len - Lq + j) sees keys <= p, and with a `sliding_window` W only keys > p - W.
    Cache blocks wholly before every query's window are not read. A sequence with seq_len 0
    gets zeros. A float8 cache's keys and values are its entries times k_scale and v_scale.
    Returns [T, Hq, D]."""
    require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal,
                            sliding_window, k_scale, v_scale)
    return implementation("paged_attention", q.device)(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables,
        max_seqlen_q=int(max_seqlen_q), scale=float(scale), causal=causal, sliding_window=sliding_window,
        k_scale=float(k_scale), v_scale=float(v_scale))


def qk_norm_rope_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, cu_seqlens_q,
                           seq_lens, block_tables, max_seqlen_q, scale, sliding_window: int | None = None,
                           q_weight=None, k_weight=None, eps: float = 1e-6, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """qk_norm_rope_store, then causal paged_attention over the caches it wrote: an attention
    layer's work after its qkv projection. Decode steps of a few sequences run it as one kernel
    and the split merge (docs/attention.md). Returns [T, Hq, D]; q may be rewritten in place,
    k and v are left as they are."""
    require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight,
                               k_scale, v_scale)
    require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, True,
                            sliding_window, k_scale, v_scale)
    return implementation("qk_norm_rope_attention", q.device)(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens, block_tables=block_tables, max_seqlen_q=int(max_seqlen_q), scale=float(scale),
        sliding_window=sliding_window, q_weight=q_weight, k_weight=k_weight, eps=float(eps),
        k_scale=float(k_scale), v_scale=float(v_scale))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, top_ks=None, top_ps=None,
           min_ps=None, *, max_top_k: int | None = None, logprobs: bool = False):
    """One token per row of logits [B, V], drawn from softmax(logits / T) restricted by the
    row's filters, without a sort. Tokens rank by logit, ties by lower id. min_ps[i]: keep
    tokens with p >= min_p * p_max (0: off); top_ks[i]: keep the first k ranks (outside
    [1, V): off); top_ps[i]: then keep the ranks before which less than top_p of the mass left
    lies (1: off); the first rank survives every filter. The noise is keyed by seeds[i] (int64,
    < 2^31) and the token id alone, so a row's token does not depend on the batch;
    argmax(logits) where temperatures[i] == 0.
    -inf logits are never drawn. Each filter is a [B] tensor or None (no row uses it).

    max_top_k: a bound, known on the host, on how many tokens top-k / top-p may keep in any row:
    the largest top_k among rows that set top_k or top_p, the vocabulary size for a row with
    top_p and no top_k (None: unknown). Up to kernels.sampling.SORT_FREE_TOP_K (256) rows are
    filtered without a sort, above it through one; a row asking for more than the bound keeps
    max_top_k tokens. Returns (tokens int64 [B], logprobs): with `logprobs`, the float32 [B]
    log_softmax(logits / T)[token] of the unfiltered distribution (T = 1 for greedy rows), else
    None."""
    require_float(logits, "logits")
    require(logits.dim() == 2, "logits", lambda: f"must be [rows, vocab], got shape {tuple(logits.shape)}")
    require_row_vector(temperatures, logits, "temperatures", require_float)
    require_row_vector(seeds, logits, "seeds", require_index)
    for name, values, kind in (("top_ks", top_ks, require_index), ("top_ps", top_ps, require_float),
                               ("min_ps", min_ps, require_float)):
        if values is not None:
            require_row_vector(values, logits, name, kind)
    require(max_top_k is None or (isinstance(max_top_k, int) and max_top_k >= 1), "max_top_k",
            lambda: f"must be a positive int or None, got {max_top_k!r}")
    return implementation("sample", logits.device)(logits, temperatures, seeds, top_ks, top_ps, min_ps,
                                                   max_top_k, bool(logprobs))
