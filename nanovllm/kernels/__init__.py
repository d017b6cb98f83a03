"""The kernel boundary: every layer calls only these functions. Each checks its arguments
(a ValueError naming the argument, before any launch) and then runs the Triton kernel or the
PyTorch reference, as `dispatch` decides."""
import itertools
import math
import os

import torch
import torch.nn.functional as F

from nanovllm.kernels import dispatch
from nanovllm.kernels.dispatch import KERNELS_AVAILABLE, backend_for, implementation
from nanovllm.utils.timing import benchmark_kernel  # noqa: F401  (importable from here too; not a kernel)

__all__ = [
    "KERNELS_AVAILABLE", "backend_for", "graph_capturable",
    "silu_and_mul", "gelu_and_mul", "fused_add_gelu", "element_wise_mul_add", "rms_norm",
    "fused_add_rms_norm", "apply_rotary_emb", "store_kvcache", "qk_norm_rope_store", "paged_attention",
    "qk_norm_rope_attention",
    "sample", "small_batch_linear", "linear", "norm_linear", "embed_norm_linear", "linear_act", "act_linear",
    "GEMV_MAX_ROWS",
    "staged_values", "staged_length", "stage_inputs", "publish_tokens", "STAGE_SLOT_MIN",
]
# Sets: membership in a tuple compares dtypes one by one, several times slower.
_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_INDEX_DTYPES = frozenset((torch.int32, torch.int64))
_GEMV_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
GEMV_MAX_ROWS = 16  # nanovllm.kernels.gemv.MAX_ROWS, without importing Triton here
GEMV_ROW_MAX_ROWS = 2  # nanovllm.kernels.gemv.ROW_MAX_ROWS: where norm_linear, embed_norm_linear, linear_act
# and act_linear fuse
# Values of a staging slot that stage_inputs reads before it knows which slot is the step's: a
# slot holds at least this many.
STAGE_SLOT_MIN = 256
# linear() sends small CUDA batches to small_batch_linear; NANOVLLM_GEMV=0 keeps F.linear (cuBLAS).
gemv_enabled = KERNELS_AVAILABLE and os.environ.get("NANOVLLM_GEMV", "1") != "0"


def _require(condition: bool, name: str, message) -> None:
    """`message`: a string, or a function making it, so that a passing check formats nothing
    (formatting shapes costs about a microsecond, and there are several checks a call)."""
    if not condition:
        raise ValueError(f"{name}: {message() if callable(message) else message}")


def _require_float(x: torch.Tensor, name: str) -> None:
    _require(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, name, "must be a floating-point tensor")


def _require_like(x: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    _require_float(x, name)
    _require(x.shape == ref.shape, name, lambda: f"shape {tuple(x.shape)} differs from {ref_name}'s {tuple(ref.shape)}")
    _require(x.dtype == ref.dtype, name, lambda: f"dtype {x.dtype} differs from {ref_name}'s {ref.dtype}")
    _require(x.device == ref.device, name, lambda: f"device {x.device} differs from {ref_name}'s {ref.device}")


def _require_index(x: torch.Tensor, name: str, ndim: int) -> None:
    _require(isinstance(x, torch.Tensor) and x.dtype in _INDEX_DTYPES, name, "must be an int32 or int64 tensor")
    _require(x.dim() == ndim, name, lambda: f"must have {ndim} dimension(s), got shape {tuple(x.shape)}")


def _require_approximate(approximate: str) -> None:
    _require(approximate in ("tanh", "none"), "approximate", lambda: f"must be 'tanh' or 'none', got {approximate!r}")


def _require_last_dim_vector(x: torch.Tensor, vector: torch.Tensor, name: str) -> None:
    _require_float(x, "x")
    _require_float(vector, name)
    _require(vector.shape == (x.shape[-1],), name, lambda: f"shape {tuple(vector.shape)} must be ({x.shape[-1]},)")
    # float32 too: a vector kept in fp32 for precision (Gemma's 1 + w); every kernel upcasts it
    _require(vector.dtype in (x.dtype, torch.float32), name,
             lambda: f"dtype {vector.dtype} must be x's {x.dtype} or torch.float32")


def _require_gated(x: torch.Tensor) -> None:
    _require_float(x, "x")
    _require(x.dim() >= 1 and x.shape[-1] % 2 == 0, "x",
             lambda: f"last dimension must be even, got shape {tuple(x.shape)}")


def graph_capturable(device: torch.device | str, sampling: bool = False) -> bool:
    """Whether the kernels on `device` run without host synchronisation (CUDA-graph safe);
    with `sampling`, `sample` too: the Triton sampler, the one tested under capture (the
    reference's draws synchronise)."""
    return (torch.device(device).type == "cuda" and backend_for(device) == "triton"
            and (not sampling or dispatch.SAMPLER == "triton"))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[..., 2d] -> silu(x[..., :d]) * x[..., d:]"""
    _require_gated(x)
    return implementation("silu_and_mul", x.device)(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """x[..., 2d] -> gelu(x[..., :d]) * x[..., d:]"""
    _require_gated(x)
    _require_approximate(approximate)
    return implementation("gelu_and_mul", x.device)(x, approximate)


def fused_add_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias), bias of shape [x.shape[-1]]."""
    _require_last_dim_vector(x, bias, "bias")
    _require_approximate(approximate)
    return implementation("fused_add_gelu", x.device)(x, bias, approximate)


def element_wise_mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c, all of one shape and dtype."""
    _require_float(a, "a")
    _require_like(b, a, "b", "a")
    _require_like(c, a, "c", "a")
    return implementation("element_wise_mul_add", a.device)(a, b, c)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in x's dtype; weight is
    x's dtype or float32."""
    _require_last_dim_vector(x, weight, "weight")
    return implementation("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual). May reuse the memory of x and residual:
    callers must not read either afterwards."""
    _require_last_dim_vector(x, weight, "weight")
    _require_like(residual, x, "residual", "x")
    return implementation("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def _require_cos_sin_cache(cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    _require_float(cos_sin_cache, "cos_sin_cache")
    _require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cos_sin_cache",
             lambda: f"must be [max_position, {head_dim}], got shape {tuple(cos_sin_cache.shape)}")


def apply_rotary_emb(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox-style rotary embedding. q [T, Hq, D], k [T, Hk, D], positions [T],
    cos_sin_cache [max_position, D] holding cos in its first half and sin in its second.
    Returns (q, k) rotated; may rotate them in place."""
    _require_index(positions, "positions", 1)
    _require_float(q, "q")
    _require_float(k, "k")
    _require(q.dim() == 3, "q", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    _require(k.dim() == 3, "k", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(k.shape)}")
    _require(q.shape[0] == positions.shape[0], "q", "token count differs from positions'")
    _require(k.shape[0] == positions.shape[0], "k", "token count differs from positions'")
    _require(k.shape[2] == q.shape[2] and q.shape[2] % 2 == 0, "k", "head_dim must be even and equal q's")
    _require(k.dtype == q.dtype, "k", lambda: f"dtype {k.dtype} differs from q's {q.dtype}")
    _require_cos_sin_cache(cos_sin_cache, q.shape[2])
    return implementation("apply_rotary_emb", q.device)(positions, q, k, cos_sin_cache)


def _require_cache(cache: torch.Tensor, name: str) -> None:
    _require_float(cache, name)
    _require(cache.dim() == 4, name,
             lambda: f"must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}")


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Writes key/value [T, Hk, D] into the paged caches at slot_mapping[T]
    (slot = block * block_size + offset); slot -1 is skipped."""
    _require_cache(k_cache, "k_cache")
    _require_like(v_cache, k_cache, "v_cache", "k_cache")
    _require_float(key, "key")
    _require_like(value, key, "value", "key")
    _require(key.dim() == 3 and key.shape[1:] == k_cache.shape[2:], "key",
             lambda: f"shape {tuple(key.shape)} must be [tokens, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    _require_index(slot_mapping, "slot_mapping", 1)
    _require(slot_mapping.shape[0] == key.shape[0], "slot_mapping", "length differs from key's token count")
    implementation("store_kvcache", key.device)(key, value, k_cache, v_cache, slot_mapping)


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       q_weight=None, k_weight=None, eps: float = 1e-6) -> torch.Tensor:
    """What lies between the qkv projection and attention, in one launch: with q_weight and
    k_weight, rms_norm of each q and k head (Qwen3); apply_rotary_emb of q and k; k and v
    written to the paged caches at slot_mapping (-1 skipped). q [T, Hq, D] is rewritten in
    place and returned; k and v [T, Hk, D] are left as they are. The caches need unit
    stride along head_dim."""
    _require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight)
    return implementation("qk_norm_rope_store", q.device)(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                                          slot_mapping, q_weight, k_weight, float(eps))


def _require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight,
                                k_weight) -> None:
    _require_float(q, "q")
    _require(q.dim() == 3 and q.shape[2] % 2 == 0, "q",
             lambda: f"must be [tokens, heads, even head_dim], got {tuple(q.shape)}")
    _require(isinstance(k, torch.Tensor) and k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2],
             "k", lambda: f"shape {tuple(k.shape)} must be [{q.shape[0]}, kv_heads, {q.shape[2]}]")
    _require(k.dtype == q.dtype, "k", lambda: f"dtype {k.dtype} differs from q's {q.dtype}")
    _require_like(v, k, "v", "k")
    _require_index(positions, "positions", 1)
    _require(positions.shape[0] == q.shape[0], "positions", "length differs from q's token count")
    _require_cos_sin_cache(cos_sin_cache, q.shape[2])
    _require_cache(k_cache, "k_cache")
    _require(k_cache.shape[2:] == k.shape[1:] and k_cache.stride(3) == 1, "k_cache",
             lambda: f"must be [blocks, block_size, {k.shape[1]}, {k.shape[2]}] with unit stride along head_dim")
    _require_like(v_cache, k_cache, "v_cache", "k_cache")
    _require(v_cache.stride(3) == 1, "v_cache", "must have unit stride along head_dim")
    _require_index(slot_mapping, "slot_mapping", 1)
    _require(slot_mapping.shape[0] == q.shape[0], "slot_mapping", "length differs from q's token count")
    _require((q_weight is None) == (k_weight is None), "k_weight", "q_weight and k_weight come together")
    if q_weight is not None:
        _require_last_dim_vector(q, q_weight, "q_weight")
        _require_last_dim_vector(k, k_weight, "k_weight")


def paged_attention(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal=True,
                    sliding_window: int | None = None):
    """Attention of packed queries q [T, Hq, D] over the paged caches. Sequence i owns query rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys 0..seq_lens[i]-1 (cached + new) through
    block_tables[i]; with `causal`, query row j of a sequence of Lq rows (at position
    p = seq_len - Lq + j) sees keys <= p, and with a `sliding_window` W only keys > p - W.
    Cache blocks wholly before every query's window are not read. A sequence with seq_len 0
    gets zeros. Returns [T, Hq, D]."""
    _require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal,
                             sliding_window)
    return implementation("paged_attention", q.device)(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables,
        max_seqlen_q=int(max_seqlen_q), scale=float(scale), causal=causal, sliding_window=sliding_window)


def _require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal,
                             sliding_window) -> None:
    _require_float(q, "q")
    _require(q.dim() == 3, "q", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    _require_cache(k_cache, "k_cache")
    _require_like(v_cache, k_cache, "v_cache", "k_cache")
    _require(k_cache.shape[3] == q.shape[2], "k_cache", "head_dim differs from q's")
    _require(q.shape[1] % k_cache.shape[2] == 0, "q", "query heads must be a multiple of the cache's kv heads")
    # key tiles start at multiples of their width, which must divide the block to stay inside it
    block_size = k_cache.shape[1]
    _require(block_size > 0 and block_size & (block_size - 1) == 0, "k_cache",
             lambda: f"block size (dim 1) must be a power of two, got {block_size}")
    _require_index(cu_seqlens_q, "cu_seqlens_q", 1)
    _require_index(seq_lens, "seq_lens", 1)
    _require_index(block_tables, "block_tables", 2)
    _require(cu_seqlens_q.shape[0] == seq_lens.shape[0] + 1, "cu_seqlens_q", "must have len(seq_lens) + 1 entries")
    _require(block_tables.shape[0] == seq_lens.shape[0], "block_tables", "must have one row per sequence")
    _require(int(max_seqlen_q) >= 1, "max_seqlen_q", "must be at least 1")
    # the kernel takes each row's max of unscaled scores, which only a positive scale preserves
    _require(float(scale) > 0, "scale", lambda: f"must be positive, got {scale}")
    if sliding_window is not None:
        _require(isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1,
                 "sliding_window", lambda: f"must be None or an int >= 1, got {sliding_window!r}")
        _require(causal, "sliding_window", "needs causal attention")


def qk_norm_rope_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, cu_seqlens_q,
                           seq_lens, block_tables, max_seqlen_q, scale, sliding_window: int | None = None,
                           q_weight=None, k_weight=None, eps: float = 1e-6) -> torch.Tensor:
    """qk_norm_rope_store, then causal paged_attention over the caches it wrote: an attention
    layer's work after its qkv projection. Decode steps of a few sequences run it as one kernel
    and the split merge (docs/attention.md). Returns [T, Hq, D]; q may be rewritten in place,
    k and v are left as they are."""
    _require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight)
    _require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, True,
                             sliding_window)
    return implementation("qk_norm_rope_attention", q.device)(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens, block_tables=block_tables, max_seqlen_q=int(max_seqlen_q), scale=float(scale),
        sliding_window=sliding_window, q_weight=q_weight, k_weight=k_weight, eps=float(eps))


def _require_row_vector(x, logits: torch.Tensor, name: str, kind) -> None:
    kind(x, name) if kind is _require_float else kind(x, name, 1)
    _require(x.shape == logits.shape[:1], name, lambda: f"must have one entry per row, got shape {tuple(x.shape)}")
    _require(x.device == logits.device, name, lambda: f"device {x.device} differs from logits' {logits.device}")


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
    _require_float(logits, "logits")
    _require(logits.dim() == 2, "logits", lambda: f"must be [rows, vocab], got shape {tuple(logits.shape)}")
    _require_row_vector(temperatures, logits, "temperatures", _require_float)
    _require_row_vector(seeds, logits, "seeds", _require_index)
    for name, values, kind in (("top_ks", top_ks, _require_index), ("top_ps", top_ps, _require_float),
                               ("min_ps", min_ps, _require_float)):
        if values is not None:
            _require_row_vector(values, logits, name, kind)
    _require(max_top_k is None or (isinstance(max_top_k, int) and max_top_k >= 1), "max_top_k",
             lambda: f"must be a positive int or None, got {max_top_k!r}")
    return implementation("sample", logits.device)(logits, temperatures, seeds, top_ks, top_ps, min_ps,
                                                   max_top_k, bool(logprobs))


def _require_weight(weight: torch.Tensor, k: int) -> None:
    _require_float(weight, "weight")
    _require(weight.dim() == 2 and weight.shape[1] == k, "weight",
             lambda: f"shape {tuple(weight.shape)} must be [N, {k}]")


def _require_gemv_operands(x: torch.Tensor, weight: torch.Tensor, bias, prefetch, k: int) -> None:
    """x's dtype, a weight [N, k] and bias [N] like it, a contiguous prefetch on x's device."""
    _require(isinstance(x, torch.Tensor) and x.dtype in _GEMV_DTYPES, "x",
             "must be a float16, bfloat16 or float32 tensor")
    _require_weight(weight, k)
    _require_linear_operands(x, weight, bias, prefetch)


def _require_linear_operands(x: torch.Tensor, weight: torch.Tensor, bias, prefetch) -> None:
    """A weight and bias [N] of x's dtype and device, a contiguous prefetch on x's device."""
    _require(weight.dtype == x.dtype, "weight", lambda: f"dtype {weight.dtype} differs from x's {x.dtype}")
    _require(weight.device == x.device, "weight", lambda: f"device {weight.device} differs from x's {x.device}")
    if bias is not None:
        _require_float(bias, "bias")
        _require(bias.shape == weight.shape[:1], "bias", lambda: f"shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
        _require(bias.dtype == x.dtype, "bias", lambda: f"dtype {bias.dtype} differs from x's {x.dtype}")
        _require(bias.device == x.device, "bias", lambda: f"device {bias.device} differs from x's {x.device}")
    if prefetch is not None:
        _require(isinstance(prefetch, torch.Tensor) and prefetch.is_contiguous(), "prefetch",
                 "must be a contiguous tensor or None")
        _require(prefetch.device == x.device, "prefetch",
                 lambda: f"device {prefetch.device} differs from x's {x.device}")


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) for at most GEMV_MAX_ROWS rows of x (decode
    batches): a split-K GEMV that reads the weight once at close to copy bandwidth (one or two
    rows: a split-free kernel). float16, bfloat16 or float32. Returns a new contiguous [..., N]
    tensor. `prefetch`: a contiguous tensor on x's device, read into the L2 cache while the
    split-K kernel waits for its input (the next projection's weight; the one- and two-row
    kernel does not prefetch); it does not change the result."""
    _require(isinstance(x, torch.Tensor) and x.dtype in _GEMV_DTYPES, "x",
             "must be a float16, bfloat16 or float32 tensor")
    _require(x.dim() >= 1 and math.prod(x.shape[:-1]) <= GEMV_MAX_ROWS, "x",
             lambda: f"must be [..., K] with at most {GEMV_MAX_ROWS} rows, got shape {tuple(x.shape)}")
    _require_gemv_operands(x, weight, bias, prefetch, x.shape[-1])
    return implementation("small_batch_linear", x.device)(x, weight, bias, prefetch)


def _few_rows_on_gemv(x: torch.Tensor, rows: int | None = None) -> bool:
    """x's rows (`rows` where x is not the input itself) go to the row kernel."""
    return (gemv_enabled and x.is_cuda and x.dtype in _GEMV_DTYPES
            and (x.numel() <= GEMV_ROW_MAX_ROWS * x.shape[-1] if rows is None else rows <= GEMV_ROW_MAX_ROWS))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, prefetch: torch.Tensor | None = None,
                leave_room: bool = False, activation: str | None = None):
    """A pre-norm decoder's norm and the projection after it: with a residual,
    (linear(rms_norm(x + residual)), x + residual), without one (linear(rms_norm(x)), x).
    One kernel where one or two CUDA rows go to the small-batch GEMV's row kernel (decode of 1-2),
    else fused_add_rms_norm or rms_norm, then linear(). May reuse the memory of x and residual:
    callers must not read either afterwards. `leave_room`: the kernel after this one starts its
    programs beside this one's and needs room on every SM (the decode attention after qkv): the
    row kernel then puts fewer of its programs on an SM. `activation` ("silu", "gelu",
    "gelu_tanh"): weight is a gated MLP's gate above its up, and the projection's output is
    linear_act's, act(gate) * up (in the same kernel where it fuses)."""
    _require_last_dim_vector(x, norm_weight, "norm_weight")
    if residual is not None:
        _require_like(residual, x, "residual", "x")
    _require_weight(weight, x.shape[-1])
    _require_linear_operands(x, weight, bias, prefetch)  # before any kernel consumes x and residual
    if activation is not None:
        _require_gated_weight(weight, activation)
    if _few_rows_on_gemv(x):
        fused = implementation("norm_linear", x.device)(x, residual, norm_weight, eps, weight, bias, prefetch,
                                                         leave_room, activation)
        if fused is not None:
            return fused
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    if activation is None:
        return linear(normed, weight, bias, prefetch), residual
    return _checked_linear_act(normed, weight, bias, prefetch, activation), residual


def embed_norm_linear(input_ids: torch.Tensor, embed_weight: torch.Tensor, embed_scale: float | None,
                      norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      leave_room: bool = False):
    """A decoder's first norm and projection from its token ids: (linear(rms_norm(e)), e) for
    e = embed_weight[input_ids], times embed_scale rounded to the table's dtype where that is
    not None (Gemma). One kernel where one or two ids on CUDA go to the row kernel, which looks
    their rows up in its prologue (the embedding's own launch leaves small decode steps); else
    the lookup, then norm_linear. Ids must lie in [0, embed_weight.shape[0]): the kernel reads
    the rows they name unchecked, and the engine rejects prompts with other ids."""
    _require(isinstance(input_ids, torch.Tensor) and input_ids.dtype == torch.int64 and input_ids.dim() == 1,
             "input_ids", "must be a 1-D int64 tensor")
    _require_float(embed_weight, "embed_weight")
    _require(embed_weight.dim() == 2, "embed_weight", lambda: f"must be [vocab, K], got shape {tuple(embed_weight.shape)}")
    _require(input_ids.device == embed_weight.device, "input_ids",
             lambda: f"device {input_ids.device} differs from embed_weight's {embed_weight.device}")
    _require(embed_scale is None or isinstance(embed_scale, float), "embed_scale", "must be a float or None")
    _require_last_dim_vector(embed_weight, norm_weight, "norm_weight")
    _require_weight(weight, embed_weight.shape[1])
    _require_linear_operands(embed_weight, weight, bias, None)
    if _few_rows_on_gemv(embed_weight, input_ids.numel()):
        fused = implementation("embed_norm_linear", embed_weight.device)(
            input_ids, embed_weight, embed_scale, norm_weight, eps, weight, bias, leave_room)
        if fused is not None:
            return fused
    embedded = F.embedding(input_ids, embed_weight)
    if embed_scale is not None:
        embedded = embedded * embed_scale  # computed in fp32 for half dtypes, then rounded
    return norm_linear(embedded, None, norm_weight, eps, weight, bias, None, leave_room)


_GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu": lambda x: gelu_and_mul(x, "none"),
                      "gelu_tanh": lambda x: gelu_and_mul(x, "tanh")}


def _require_activation(activation: str) -> None:
    _require(activation in _GATED_ACTIVATIONS, "activation",
             lambda: f"must be one of {sorted(_GATED_ACTIVATIONS)}, got {activation!r}")


def _require_gated_weight(weight: torch.Tensor, activation: str) -> None:
    _require_activation(activation)
    _require(weight.shape[0] % 2 == 0, "weight",
             lambda: f"must hold a gate and an up projection of equal size, got {weight.shape[0]} rows")


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               prefetch: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """act(y[..., :N]) * y[..., N:] for y = linear(x, weight, bias) and weight [2N, K]: a gated
    MLP's gate_up projection with its activation. activation: "silu", "gelu" (erf) or
    "gelu_tanh". One kernel where one or two CUDA rows go to the row kernel, which computes
    each feature's gate and up in one program and the activation once, in its epilogue; else
    linear(), then the activation kernel."""
    _require_weight(weight, x.shape[-1])
    _require_linear_operands(x, weight, bias, prefetch)
    _require_gated_weight(weight, activation)
    return _checked_linear_act(x, weight, bias, prefetch, activation)


def _checked_linear_act(x, weight, bias, prefetch, activation: str) -> torch.Tensor:
    """linear_act on operands already checked (norm_linear's unfused path checks them first)."""
    if _few_rows_on_gemv(x):
        fused = implementation("linear_act", x.device)(x, weight, bias, prefetch, activation)
        if fused is not None:
            return fused
    return _GATED_ACTIVATIONS[activation](linear(x, weight, bias, prefetch))


def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               prefetch: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """linear(act(x[..., :K]) * x[..., K:]) for x [..., 2K] and weight [N, K]: a gated MLP's
    activation and down projection. activation: "silu", "gelu" (erf) or "gelu_tanh". One
    kernel where one or two CUDA rows go to the small-batch GEMV's row kernel, else the activation
    kernel then linear()."""
    _require_activation(activation)
    _require_gated(x)
    _require_weight(weight, x.shape[-1] // 2)
    _require_linear_operands(x, weight, bias, prefetch)
    if _few_rows_on_gemv(x):
        fused = implementation("act_linear", x.device)(x, weight, bias, prefetch, activation)
        if fused is not None:
            return fused
    return linear(_GATED_ACTIVATIONS[activation](x), weight, bias, prefetch)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that CUDA inputs of at most GEMV_MAX_ROWS rows go to small_batch_linear
    (unless gemv_enabled is off), with `prefetch`. Under a captured graph the choice is that
    of the captured batch size."""
    if gemv_enabled and x.is_cuda and x.dtype in _GEMV_DTYPES and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return small_batch_linear(x, weight, bias, prefetch)
    return F.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a float8_e4m3fn W times its fp32 multipliers `scale`: [N, 1] per output
    row (block None) or one per block[0] x block[1] tile (kernels/fp8.py)."""
    _require(weight.dtype == torch.float8_e4m3fn, "weight", f"must be float8_e4m3fn, got {weight.dtype}")
    return implementation("fp8_linear", x.device)(x, weight, scale, block, bias)


def staged_values(token_rows: list[list[int]], seq_rows: list[list[int]], block_tables: list[list[int]]) -> list[int]:
    """A step's inputs in the layout stage_inputs reads from a slot (kernels/staging.py): three
    per-token rows (input ids, an id below 0 being -1 - the index of a token sampled last;
    positions; slot mapping), four per-sequence rows of one more value (sequence lengths,
    cu_seqlens_q, sampling seeds, temperatures as float32 bits) and the block tables, all of
    equal width."""
    width = len(block_tables[0]) if block_tables else 0
    return [len(block_tables), width, *itertools.chain(*token_rows, *seq_rows, *block_tables)]


def staged_length(num_tokens: int, num_seqs: int, table_values: int) -> int:
    """The columns a slot needs for steps of up to these sizes (staged_values' values, at least
    STAGE_SLOT_MIN)."""
    return max(2 + 3 * num_tokens + 4 * (num_seqs + 1) + table_values, STAGE_SLOT_MIN)


def stage_inputs(slots: torch.Tensor, parity: torch.Tensor, samples: torch.Tensor, token_rows: torch.Tensor,
                 seq_rows: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, num_seqs: int) -> None:
    """Places the step that the host wrote (staged_values) into slot `parity` of `slots`
    (int32 [2, >= STAGE_SLOT_MIN], pinned for CUDA) into a graph's inputs: token_rows[:, :num_tokens]
    (int64 [3, T]), seq_rows[:, :num_seqs + 1] (int32 [4, S]) and the block tables' leading
    rows and columns (int32 [S, W]), input ids below 0 taken from samples (int64); then flips
    parity (int32 [1], on the inputs' device). The host must not write a slot that a launch
    may still read: double buffering, kernels/staging.py."""
    _require(isinstance(slots, torch.Tensor) and slots.dtype == torch.int32 and slots.dim() == 2
             and slots.shape[0] == 2 and slots.shape[1] >= STAGE_SLOT_MIN and slots.stride(1) == 1, "slots",
             lambda: f"must be a row-contiguous int32 tensor [2, >= {STAGE_SLOT_MIN}]")
    _require(parity.dtype == torch.int32 and parity.numel() == 1, "parity", "must be one int32")
    _require(samples.dtype == torch.int64, "samples", "must be int64")
    _require(token_rows.dtype == torch.int64 and token_rows.dim() == 2 and token_rows.shape[0] == 3
             and num_tokens <= token_rows.shape[1], "token_rows", lambda: f"must be int64 [3, >= {num_tokens}]")
    _require(seq_rows.dtype == torch.int32 and seq_rows.dim() == 2 and seq_rows.shape[0] == 4
             and num_seqs < seq_rows.shape[1], "seq_rows", lambda: f"must be int32 [4, > {num_seqs}]")
    _require(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] >= num_seqs,
             "block_tables", lambda: f"must be int32 [>= {num_seqs}, width]")
    for name, t in (("token_rows", token_rows), ("seq_rows", seq_rows), ("block_tables", block_tables)):
        _require(t.stride(1) == 1, name, "rows must be contiguous")
    implementation("stage_inputs", token_rows.device)(slots, parity, samples, token_rows, seq_rows, block_tables,
                                                      num_tokens, num_seqs)


def publish_tokens(tokens: torch.Tensor, last: torch.Tensor, host_slots: torch.Tensor, parity: torch.Tensor) -> None:
    """Stores sampled token ids (int64 [n]) into last[:n], where the next step's input ids
    below 0 read them, and into row `parity` of host_slots (int64 [2, >= n], pinned for CUDA),
    then flips parity (int32 [1], on the tokens' device)."""
    n = tokens.shape[0]
    _require(tokens.dtype == torch.int64 and tokens.dim() == 1 and tokens.is_contiguous(), "tokens",
             "must be a contiguous int64 vector")
    _require(last.dtype == torch.int64 and last.shape[0] >= n, "last", lambda: f"must be int64 [>= {n}]")
    _require(host_slots.dtype == torch.int64 and host_slots.dim() == 2 and host_slots.shape[0] == 2
             and host_slots.shape[1] >= n and host_slots.stride(1) == 1, "host_slots",
             lambda: f"must be int64 [2, >= {n}]")
    _require(parity.dtype == torch.int32 and parity.numel() == 1, "parity", "must be one int32")
    implementation("publish_tokens", tokens.device)(tokens, last, host_slots, parity)
