"""The PyTorch reference paged attention (the fallback and the definition the Triton kernel is
tested against) against a naive per-query float64 computation, on both of its paths: the
per-sequence loop and the batched decode step."""
import pytest
import torch

from nanovllm.kernels import reference


def naive(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window=None):
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = range(cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item())
        keys = k_cache[block_tables[i].clamp_min(0).long()].flatten(0, 1)[:seq_len]
        values = v_cache[block_tables[i].clamp_min(0).long()].flatten(0, 1)[:seq_len]
        for j, row in enumerate(rows):
            visible = seq_len - len(rows) + j + 1
            first = max(visible - window, 0) if window else 0
            for head in range(q.shape[1]):
                scores = keys[first:visible, head // group] @ q[row, head] * scale
                out[row, head] = scores.softmax(0) @ values[first:visible, head // group]
    return out


def make(query_lens, seq_lens, heads=(6, 2), head_dim=32, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width
    k_cache = torch.randn(num_blocks, block_size, heads[1], head_dim, dtype=torch.float64, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, heads[1], head_dim, dtype=torch.float64, generator=gen)
    block_tables = torch.randperm(num_blocks, generator=gen)[:len(seq_lens) * width].view(len(seq_lens), width)
    block_tables[:, -1] = -1  # padding past every sequence's last block
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for row, n in zip(block_tables, seq_lens):
        for i in range(n):
            owned[row[i // block_size], i % block_size] = True
    k_cache[~owned], v_cache[~owned] = float("nan"), float("nan")  # what no sequence owns is never read
    cu = torch.tensor([0, *query_lens]).cumsum(0)
    q = torch.randn(int(cu[-1]), heads[0], head_dim, dtype=torch.float64, generator=gen)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens), block_tables.int()


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1, 1], [40, 1, 0, 63]), ([5, 1, 17, 3], [18, 33, 17, 3])])
def test_reference_matches_naive_attention(query_lens, seq_lens):
    q, k_cache, v_cache, cu, lens, tables = make(query_lens, seq_lens)
    got = reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables,
                                    max_seqlen_q=max(query_lens), scale=0.3)
    want = naive(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), cu, lens, tables, 0.3)
    assert ((got - want).norm() / want.norm()).item() < 1e-12


@pytest.mark.parametrize("window", [1, 7, 20])
@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1, 1], [40, 1, 0, 63]), ([5, 1, 17, 3], [18, 33, 17, 3])])
def test_reference_sliding_window_matches_naive_attention(query_lens, seq_lens, window):
    """Keys before every query's window are NaN: the reference must not let them in."""
    q, k_cache, v_cache, cu, lens, tables = make(query_lens, seq_lens)
    for row, rows, n in zip(tables, query_lens, seq_lens):
        for key in range(max(n - rows + 1 - window, 0)):
            for cache in (k_cache, v_cache):
                cache[row[key // 16], key % 16] = float("nan")
    got = reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables,
                                    max_seqlen_q=max(query_lens), scale=0.3, sliding_window=window)
    want = naive(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), cu, lens, tables, 0.3, window)
    assert ((got - want).norm() / want.norm()).item() < 1e-12
