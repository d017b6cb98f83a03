import pytest
import torch
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, randn,
                            require_triton, upcast)

from nanovllm.kernels import apply_rotary_emb, reference

MAX_POSITION = 2048


def cos_sin_cache(head_dim: int, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def packed_qkv(tokens, q_heads, kv_heads, head_dim, dtype, device):
    """The qkv projection output and its q, k, v head views (token stride (Hq + 2 Hk) * D)."""
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    return qkv, *qkv.view(tokens, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=1)


def _check(positions, q, k, cache, dtype):
    expected_q, expected_k = reference.apply_rotary_emb(positions, *upcast(q, k, cache))
    out_q, out_k = apply_rotary_emb(positions, q, k, cache)
    assert_close(out_q, expected_q, dtype)
    assert_close(out_k, expected_k, dtype)
    return out_q, out_k


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 16, 8, 128), (7, 4, 2, 96), (5, 3, 1, 64)])
def test_rotates_packed_qkv_views_in_place(device, dtype, tokens, q_heads, kv_heads, head_dim):
    """head_dim 96: a half of 48 is not a power of two. v, between k and the next token's q,
    must be left as it was."""
    require_triton(device)
    qkv, q, k, v = packed_qkv(tokens, q_heads, kv_heads, head_dim, dtype, device)
    v_before = v.clone()
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device, dtype=torch.int32)
    out_q, out_k = _check(positions, q, k, cos_sin_cache(head_dim, device), dtype)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("device,dtype", TARGETS)
def test_contiguous_q_and_k_with_int64_positions(device, dtype):
    require_triton(device)
    q, k = randn(6, 4, 128, dtype=dtype, device=device), randn(6, 1, 128, dtype=dtype, device=device)
    positions = torch.tensor([0, 1, 2, 1000, MAX_POSITION - 1, 5], device=device)
    _check(positions, q, k, cos_sin_cache(128, device), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_non_unit_head_dim_stride(device, dtype):
    require_triton(device)
    q = randn(3, 2, 64, 2, dtype=dtype, device=device)[..., 0]
    k = randn(3, 64, 1, dtype=dtype, device=device).transpose(1, 2)
    _check(torch.arange(3, device=device), q, k, cos_sin_cache(64, device), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_strided_positions(device, dtype):
    require_triton(device)
    _, q, k, _ = packed_qkv(9, 2, 1, 64, dtype, device)
    positions = torch.randint(0, MAX_POSITION, (9, 3), device=device)[:, 1]
    _check(positions, q, k, cos_sin_cache(64, device), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_many_rows_share_a_program(device, dtype):
    require_triton(device)
    _, q, k, _ = packed_qkv(201, 2, 1, 64, dtype, device)
    _check(torch.randint(0, MAX_POSITION, (201,), device=device), q, k, cos_sin_cache(64, device), dtype)


@pytest.mark.gpu
def test_cuda_graph_capture():
    qkv, q, k, _ = packed_qkv(64, 16, 8, 128, torch.bfloat16, "cuda")
    original = qkv.clone()
    positions = torch.randint(0, MAX_POSITION, (64,), device="cuda")
    cache = cos_sin_cache(128, "cuda")
    expected_q, expected_k = reference.apply_rotary_emb(positions, *upcast(q, k, cache))

    def rotate_fresh_copy():
        qkv.copy_(original)  # the warm-up and the capture run rotate it too
        return apply_rotary_emb(positions, q, k, cache)

    out_q, out_k = capture_and_replay(rotate_fresh_copy)
    assert_close(out_q, expected_q, torch.bfloat16)
    assert_close(out_k, expected_k, torch.bfloat16)


@pytest.mark.parametrize("call,name", [
    (lambda: apply_rotary_emb(torch.zeros(3), torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(16, 8)),
     "positions"),
    (lambda: apply_rotary_emb(torch.zeros(3, dtype=torch.long), torch.randn(3, 16), torch.randn(3, 1, 8),
                              torch.randn(16, 8)), "q"),
    (lambda: apply_rotary_emb(torch.zeros(3, dtype=torch.long), torch.randn(3, 2, 8), torch.randn(3, 1, 6),
                              torch.randn(16, 8)), "k"),
    (lambda: apply_rotary_emb(torch.zeros(3, dtype=torch.long), torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                              torch.randn(16, 6)), "cos_sin_cache"),
    (lambda: apply_rotary_emb(torch.zeros(4, dtype=torch.long), torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                              torch.randn(16, 8)), "q"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()
