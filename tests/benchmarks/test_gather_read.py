"""benchmarks/gather_read.py: the read-floor kernel sums exactly the keys and values it is
meant to read, through a shuffled block table (interpreter, fp32 and bf16)."""
import pytest
import torch

pytestmark = pytest.mark.triton_interpret


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
@pytest.mark.parametrize("early_tiles", [0, 2, 5])
def test_gather_read_sums_each_sequences_keys_and_values(dtype, tolerance, early_tiles):
    from benchmarks.gather_read import gather_read
    torch.manual_seed(0)
    num_seqs, block_size, kv_heads, head_dim, keys = 3, 4, 2, 16, 24
    blocks_per_seq = keys // block_size + 1  # a spare block each: keys past `keys` must not be read
    k_cache, v_cache = (torch.randn(num_seqs * blocks_per_seq, block_size, kv_heads, head_dim).to(dtype)
                        for _ in range(2))
    block_tables = torch.randperm(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq).to(torch.int32)
    out = gather_read(k_cache, v_cache, block_tables, keys, block_n=8, early_tiles=early_tiles)
    gathered = (k_cache.double() + v_cache.double())[block_tables.long()]  # [seqs, blocks, slots, heads, dim]
    expected = gathered.flatten(1, 2)[:, :keys].sum(1).reshape(num_seqs * kv_heads, head_dim)
    assert ((out.double() - expected).norm() / expected.norm()).item() < tolerance


def test_gather_read_refuses_a_ragged_key_count():
    from benchmarks.gather_read import gather_read
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gather_read(cache, cache, torch.zeros(1, 2, dtype=torch.int32), 12, block_n=8)
