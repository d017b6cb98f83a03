import pytest
import torch
from kernel_testing import FP32_INTERPRETER_AND_GPU, TARGETS, capture_and_replay, randn, require_triton

from nanovllm.kernels import reference, store_kvcache

SENTINEL = -777.0  # what every slot no token maps to must still hold


def _caches(num_blocks, block_size, kv_heads, head_dim, dtype, device):
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), SENTINEL, dtype=dtype, device=device)
    return k_cache, k_cache.clone()


def _check(key, value, k_cache, v_cache, slot_mapping):
    """A copy: the caches must equal the reference's to the bit, sentinels included."""
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    assert store_kvcache(key, value, k_cache, v_cache, slot_mapping) is None
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,kv_heads,head_dim,block_size", [(1, 8, 128, 16), (9, 3, 96, 4), (6, 1, 64, 256)])
def test_scatters_packed_kv_views_and_skips_minus_one(device, dtype, slot_dtype, tokens, kv_heads, head_dim,
                                                      block_size):
    require_triton(device)
    qkv = randn(tokens, (2 + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    _, key, value = qkv.view(tokens, -1, head_dim).split([2, kv_heads, kv_heads], dim=1)
    num_blocks = tokens + 2
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens].to(slot_dtype)
    slots[1::3] = -1
    _check(key, value, *_caches(num_blocks, block_size, kv_heads, head_dim, dtype, device), slots)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_strided_caches_and_contiguous_keys(device, dtype):
    """k and v caches as halves of one [blocks, 2, block_size, heads, dim] allocation."""
    require_triton(device)
    both = torch.full((5, 2, 8, 2, 32), SENTINEL, dtype=dtype, device=device)
    key, value = randn(4, 2, 32, dtype=dtype, device=device), randn(4, 2, 32, dtype=dtype, device=device)
    _check(key, value, both[:, 0], both[:, 1], torch.tensor([39, 0, 8, 17], device=device))


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_many_rows_share_a_program(device, dtype):
    require_triton(device)
    key, value = randn(300, 2, 64, dtype=dtype, device=device), randn(300, 2, 64, dtype=dtype, device=device)
    slots = torch.randperm(64 * 8, device=device)[:300]
    slots[::7] = -1
    _check(key, value, *_caches(64, 8, 2, 64, dtype, device), slots)


@pytest.mark.gpu
def test_offsets_past_two_to_the_31_elements():
    """2^31 + a few elements a cache: a slot in the last block lies beyond int32 offsets."""
    kv_heads, head_dim, block_size = 1, 128, 16
    num_blocks = (1 << 31) // (block_size * kv_heads * head_dim) + 1
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cuda")
    key, value = randn(2, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"), randn(
        2, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    last_slot = num_blocks * block_size - 1
    store_kvcache(key, value, k_cache, v_cache, torch.tensor([last_slot, 3], device="cuda"))
    assert torch.equal(k_cache[-1, -1], key[0]) and torch.equal(v_cache[-1, -1], value[0])
    assert torch.equal(k_cache[0, 3], key[1])
    assert (k_cache[-1, -2] == SENTINEL).all()


@pytest.mark.gpu
def test_cuda_graph_capture():
    key, value = randn(64, 8, 128, dtype=torch.bfloat16, device="cuda"), randn(64, 8, 128, dtype=torch.bfloat16,
                                                                               device="cuda")
    k_cache, v_cache = _caches(16, 16, 8, 128, torch.bfloat16, "cuda")
    slots = torch.randperm(16 * 16, device="cuda")[:64]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kvcache(key, value, expected_k, expected_v, slots)
    capture_and_replay(lambda: store_kvcache(key, value, k_cache, v_cache, slots))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("call,name", [
    (lambda: store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(4, 16, 2, 8),
                           torch.randn(4, 16, 2, 8), torch.zeros(3)), "slot_mapping"),
    (lambda: store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(4, 16, 2, 8),
                           torch.randn(4, 16, 2, 8), torch.zeros(2, dtype=torch.long)), "slot_mapping"),
    (lambda: store_kvcache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(4, 16, 2, 8),
                           torch.randn(4, 16, 2, 8), torch.zeros(3, dtype=torch.long)), "key"),
    (lambda: store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 4), torch.randn(4, 16, 2, 8),
                           torch.randn(4, 16, 2, 8), torch.zeros(3, dtype=torch.long)), "value"),
    (lambda: store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(4, 16, 2, 8),
                           torch.randn(4, 8, 2, 8), torch.zeros(3, dtype=torch.long)), "v_cache"),
    (lambda: store_kvcache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(16, 2, 8),
                           torch.randn(16, 2, 8), torch.zeros(3, dtype=torch.long)), "k_cache"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()
