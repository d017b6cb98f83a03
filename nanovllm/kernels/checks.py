"""The argument checks of the public kernel functions: each raises a ValueError naming the
argument before any launch."""
import math

import torch

# Sets: membership in a tuple compares dtypes one by one, several times slower.
FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
INDEX_DTYPES = frozenset((torch.int32, torch.int64))
# A float8 cache holds keys and values divided by their per-tensor scale (docs/attention.md#fp8-kv-cache).
FP8_CACHE_DTYPES = frozenset((torch.float8_e4m3fn,))
CACHE_DTYPES = FLOAT_DTYPES | FP8_CACHE_DTYPES
GEMV_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))


def require(condition: bool, name: str, message) -> None:
    """`message`: a string, or a function making it, so that a passing check formats nothing
    (formatting shapes costs about a microsecond, and there are several checks a call)."""
    if not condition:
        raise ValueError(f"{name}: {message() if callable(message) else message}")


def require_float(x: torch.Tensor, name: str) -> None:
    require(isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES, name, "must be a floating-point tensor")


def require_like(x: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    require_float(x, name)
    require(x.shape == ref.shape, name, lambda: f"shape {tuple(x.shape)} differs from {ref_name}'s {tuple(ref.shape)}")
    require(x.dtype == ref.dtype, name, lambda: f"dtype {x.dtype} differs from {ref_name}'s {ref.dtype}")
    require(x.device == ref.device, name, lambda: f"device {x.device} differs from {ref_name}'s {ref.device}")


def require_index(x: torch.Tensor, name: str, ndim: int) -> None:
    require(isinstance(x, torch.Tensor) and x.dtype in INDEX_DTYPES, name, "must be an int32 or int64 tensor")
    require(x.dim() == ndim, name, lambda: f"must have {ndim} dimension(s), got shape {tuple(x.shape)}")


def require_approximate(approximate: str) -> None:
    require(approximate in ("tanh", "none"), "approximate", lambda: f"must be 'tanh' or 'none', got {approximate!r}")


def require_last_dim_vector(x: torch.Tensor, vector: torch.Tensor, name: str) -> None:
    require_float(x, "x")
    require_float(vector, name)
    require(vector.shape == (x.shape[-1],), name, lambda: f"shape {tuple(vector.shape)} must be ({x.shape[-1]},)")
    # float32 too: a vector kept in fp32 for precision (Gemma's 1 + w); every kernel upcasts it
    require(vector.dtype in (x.dtype, torch.float32), name,
            lambda: f"dtype {vector.dtype} must be x's {x.dtype} or torch.float32")


def require_gated(x: torch.Tensor) -> None:
    require_float(x, "x")
    require(x.dim() >= 1 and x.shape[-1] % 2 == 0, "x",
            lambda: f"last dimension must be even, got shape {tuple(x.shape)}")


def require_cos_sin_cache(cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    require_float(cos_sin_cache, "cos_sin_cache")
    require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cos_sin_cache",
            lambda: f"must be [max_position, {head_dim}], got shape {tuple(cos_sin_cache.shape)}")


def require_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> None:
    """Caches of one shape, dtype and device; the scales positive, other than 1 only for float8 caches."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(isinstance(cache, torch.Tensor) and cache.dtype in CACHE_DTYPES, name,
                "must be a floating-point or float8_e4m3fn tensor")
        require(cache.dim() == 4, name,
                lambda: f"must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}")
    for attr in ("shape", "dtype", "device"):
        require(getattr(v_cache, attr) == getattr(k_cache, attr), "v_cache",
                lambda: f"{attr} {getattr(v_cache, attr)} differs from k_cache's {getattr(k_cache, attr)}")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, name,
                lambda: f"must be a positive finite number, got {value!r}")
        require(value == 1 or k_cache.dtype in FP8_CACHE_DTYPES, name,
                lambda: f"must be 1 for a {k_cache.dtype} cache (scales apply to float8 caches)")


def require_qk_norm_rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight,
                               k_weight, k_scale, v_scale) -> None:
    require_float(q, "q")
    require(q.dim() == 3 and q.shape[2] % 2 == 0, "q",
            lambda: f"must be [tokens, heads, even head_dim], got {tuple(q.shape)}")
    require(isinstance(k, torch.Tensor) and k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2],
            "k", lambda: f"shape {tuple(k.shape)} must be [{q.shape[0]}, kv_heads, {q.shape[2]}]")
    require(k.dtype == q.dtype, "k", lambda: f"dtype {k.dtype} differs from q's {q.dtype}")
    require_like(v, k, "v", "k")
    require_index(positions, "positions", 1)
    require(positions.shape[0] == q.shape[0], "positions", "length differs from q's token count")
    require_cos_sin_cache(cos_sin_cache, q.shape[2])
    require(isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 and k_cache.shape[2:] == k.shape[1:]
            and k_cache.stride(3) == 1, "k_cache",
            lambda: f"must be [blocks, block_size, {k.shape[1]}, {k.shape[2]}] with unit stride along head_dim")
    require_caches(k_cache, v_cache, k_scale, v_scale)
    require(v_cache.stride(3) == 1, "v_cache", "must have unit stride along head_dim")
    require_index(slot_mapping, "slot_mapping", 1)
    require(slot_mapping.shape[0] == q.shape[0], "slot_mapping", "length differs from q's token count")
    require((q_weight is None) == (k_weight is None), "k_weight", "q_weight and k_weight come together")
    if q_weight is not None:
        require_last_dim_vector(q, q_weight, "q_weight")
        require_last_dim_vector(k, k_weight, "k_weight")


def require_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal,
                            sliding_window, k_scale, v_scale) -> None:
    require_float(q, "q")
    require(q.dim() == 3, "q", lambda: f"must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    require_caches(k_cache, v_cache, k_scale, v_scale)
    require(k_cache.shape[3] == q.shape[2], "k_cache", "head_dim differs from q's")
    require(q.shape[1] % k_cache.shape[2] == 0, "q", "query heads must be a multiple of the cache's kv heads")
    # key tiles start at multiples of their width, which must divide the block to stay inside it
    block_size = k_cache.shape[1]
    require(block_size > 0 and block_size & (block_size - 1) == 0, "k_cache",
            lambda: f"block size (dim 1) must be a power of two, got {block_size}")
    require_index(cu_seqlens_q, "cu_seqlens_q", 1)
    require_index(seq_lens, "seq_lens", 1)
    require_index(block_tables, "block_tables", 2)
    require(cu_seqlens_q.shape[0] == seq_lens.shape[0] + 1, "cu_seqlens_q", "must have len(seq_lens) + 1 entries")
    require(block_tables.shape[0] == seq_lens.shape[0], "block_tables", "must have one row per sequence")
    require(int(max_seqlen_q) >= 1, "max_seqlen_q", "must be at least 1")
    # the kernel takes each row's max of unscaled scores, which only a positive scale preserves
    require(float(scale) > 0, "scale", lambda: f"must be positive, got {scale}")
    if sliding_window is not None:
        require(isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1,
                "sliding_window", lambda: f"must be None or an int >= 1, got {sliding_window!r}")
        require(causal, "sliding_window", "needs causal attention")


def require_row_vector(x, logits: torch.Tensor, name: str, kind) -> None:
    kind(x, name) if kind is require_float else kind(x, name, 1)
    require(x.shape == logits.shape[:1], name, lambda: f"must have one entry per row, got shape {tuple(x.shape)}")
    require(x.device == logits.device, name, lambda: f"device {x.device} differs from logits' {logits.device}")


def require_weight(weight: torch.Tensor, k: int) -> None:
    require_float(weight, "weight")
    require(weight.dim() == 2 and weight.shape[1] == k, "weight",
            lambda: f"shape {tuple(weight.shape)} must be [N, {k}]")


def require_gemv_operands(x: torch.Tensor, weight: torch.Tensor, bias, prefetch, k: int) -> None:
    """x's dtype, a weight [N, k] and bias [N] like it, a contiguous prefetch on x's device."""
    require(isinstance(x, torch.Tensor) and x.dtype in GEMV_DTYPES, "x",
            "must be a float16, bfloat16 or float32 tensor")
    require_weight(weight, k)
    require_linear_operands(x, weight, bias, prefetch)


def require_linear_operands(x: torch.Tensor, weight: torch.Tensor, bias, prefetch) -> None:
    """A weight and bias [N] of x's dtype and device, a contiguous prefetch on x's device."""
    require(weight.dtype == x.dtype, "weight", lambda: f"dtype {weight.dtype} differs from x's {x.dtype}")
    require(weight.device == x.device, "weight", lambda: f"device {weight.device} differs from x's {x.device}")
    if bias is not None:
        require_float(bias, "bias")
        require(bias.shape == weight.shape[:1], "bias", lambda: f"shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
        require(bias.dtype == x.dtype, "bias", lambda: f"dtype {bias.dtype} differs from x's {x.dtype}")
        require(bias.device == x.device, "bias", lambda: f"device {bias.device} differs from x's {x.device}")
    if prefetch is not None:
        require(isinstance(prefetch, torch.Tensor) and prefetch.is_contiguous(), "prefetch",
                "must be a contiguous tensor or None")
        require(prefetch.device == x.device, "prefetch",
                lambda: f"device {prefetch.device} differs from x's {x.device}")


def require_moe_operands(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """fused_moe's x [T, H], w13 [E, 2I, H] and w2 [E, H, I] of one dtype and device."""
    require(isinstance(x, torch.Tensor) and x.dtype in GEMV_DTYPES and x.dim() == 2, "x",
            "must be a float16, bfloat16 or float32 [tokens, hidden] tensor")
    for name, w in (("w13", w13), ("w2", w2)):
        require_float(w, name)
        require(w.dim() == 3 and w.dtype == x.dtype and w.device == x.device, name,
                lambda: f"must be [experts, N, K] of x's dtype and device, got {tuple(w.shape)} {w.dtype}")
    experts, gate_up, hidden = w13.shape
    require(hidden == x.shape[1] and gate_up % 2 == 0, "w13",
            lambda: f"shape {tuple(w13.shape)} must be [experts, 2 * intermediate, {x.shape[1]}]")
    require(w2.shape == (experts, hidden, gate_up // 2), "w2",
            lambda: f"shape {tuple(w2.shape)} must be ({experts}, {hidden}, {gate_up // 2})")
