"""The fused q/k norm + rotary + KV-cache write against the float64 composition of the
unfused references (tolerances per dtype in kernel_testing.TOLERANCE)."""
import pytest
import torch
from kernel_testing import FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, randn, require_triton
from test_rotary import MAX_POSITION, cos_sin_cache, packed_qkv

from nanovllm import kernels
from nanovllm.kernels import reference

SENTINEL = -777.0  # what every cache slot no token maps to must still hold


def _inputs(tokens, q_heads, kv_heads, head_dim, block_size, dtype, device):
    _, q, k, v = packed_qkv(tokens, q_heads, kv_heads, head_dim, dtype, device)
    num_blocks = tokens // block_size + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), SENTINEL, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[1::4] = -1
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    return q, k, v, positions, k_cache, k_cache.clone(), slots


def _check(q, k, v, positions, k_cache, v_cache, slots, weights, dtype):
    """q against the float64 reference; the caches: written slots against it, others untouched."""
    cache = cos_sin_cache(q.shape[2], q.device)
    expected_caches = [c.double() for c in (k_cache, v_cache)]
    k_before, v_before = k.clone(), v.clone()
    expected_q = reference.qk_norm_rope_store(q.double(), k.double(), v.double(), positions, cache.double(),
                                              *expected_caches, slots, *(w.double() for w in weights), eps=1e-6)
    out = kernels.qk_norm_rope_store(q, k, v, positions, cache, k_cache, v_cache, slots, *weights, eps=1e-6)
    assert out.data_ptr() == q.data_ptr()
    assert_close(out, expected_q, dtype)
    written = slots[slots >= 0]
    for cache_out, expected in zip((k_cache, v_cache), expected_caches):
        flat, flat_expected = cache_out.flatten(0, 1), expected.flatten(0, 1)
        assert_close(flat[written], flat_expected[written], dtype)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
        untouched[written] = False
        assert (flat[untouched] == SENTINEL).all()
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,block_size",
                         [(9, 16, 8, 128, 16), (6, 5, 1, 96, 4), (5, 4, 4, 64, 256), (701, 4, 2, 64, 16),
                          (700, 5, 1, 96, 4), (33, 6, 4, 64, 16)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "qwen2"])
def test_matches_the_unfused_composition(device, dtype, tokens, q_heads, kv_heads, head_dim, block_size, qk_norm):
    """head_dim 96: a rotary half of 48 is not a power of two; 5 over 1: an odd GQA group;
    6 over 4: q in two parts of 3 heads, one fewer than k's, so each q tile masks a head; 700
    and 701 tokens: programs of several tokens, the last one ragged."""
    require_triton(device)
    inputs = _inputs(tokens, q_heads, kv_heads, head_dim, block_size, dtype, device)
    weights = [randn(head_dim, dtype=dtype, device=device) for _ in range(2)] if qk_norm else []
    _check(*inputs, weights, dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_contiguous_q_k_v_and_int32_indices(device, dtype):
    require_triton(device)
    q, k, v = (randn(4, heads, 64, dtype=dtype, device=device) for heads in (4, 2, 2))
    k_cache = torch.full((3, 8, 2, 64), SENTINEL, dtype=dtype, device=device)
    slots = torch.tensor([3, -1, 17, 8], dtype=torch.int32, device=device)
    positions = torch.tensor([0, 5, MAX_POSITION - 1, 2], dtype=torch.int32, device=device)
    weights = [randn(64, dtype=dtype, device=device) for _ in range(2)]
    _check(q, k, v, positions, k_cache, k_cache.clone(), slots, weights, dtype)


@pytest.mark.gpu
def test_cuda_graph_capture():
    q, k, v, positions, k_cache, v_cache, slots = _inputs(64, 16, 8, 128, 16, torch.bfloat16, "cuda")
    cache = cos_sin_cache(128, "cuda")
    original_q = q.clone()
    expected = reference.qk_norm_rope_store(q.double(), k.double(), v.double(), positions, cache.double(),
                                            k_cache.double(), v_cache.double(), slots)

    def fused():
        q.copy_(original_q)
        return kernels.qk_norm_rope_store(q, k, v, positions, cache, k_cache, v_cache, slots)

    assert_close(capture_and_replay(fused), expected, torch.bfloat16)


def test_errors_name_the_argument():
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    args = dict(positions=torch.arange(2), cos_sin_cache=torch.randn(16, 8), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(2))
    with pytest.raises(ValueError, match="^v:"):
        kernels.qk_norm_rope_store(q, k, v[:, :1], **args)
    with pytest.raises(ValueError, match="^k_weight:"):
        kernels.qk_norm_rope_store(q, k, v, **args, q_weight=torch.ones(8))
    with pytest.raises(ValueError, match="^slot_mapping:"):
        kernels.qk_norm_rope_store(q, k, v, **{**args, "slot_mapping": torch.arange(3)})
    with pytest.raises(ValueError, match="^k_cache:"):
        kernels.qk_norm_rope_store(q, k, v, **{**args, "k_cache": torch.zeros(2, 4, 3, 8)})
