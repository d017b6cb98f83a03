"""The read floor of a paged decode step at the attention kernel's granularity: its grid (a
program per sequence and kv head), its key tiles gathered through the block table, its first
tiles loaded before the PDL wait, and no attention arithmetic. Each program issues every load
before it adds anything, and adds its keys and values into one sum so that no load is dead.
For short sequences the copy rate overstates what such a grid can reach: it is a single
large transfer, while these programs each start, look up their blocks and end
(docs/performance.md#paged-attention)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.launch import await_previous_kernel, dependent_launch


@triton.jit
def _tile_sum(k_ptr, v_ptr, block_table_row, start, kv_head, offs_n, offs_d, stride_kb, stride_kt, stride_kh,
              BLOCK_SIZE: tl.constexpr):
    pos = start + offs_n
    block = tl.load(block_table_row + pos // BLOCK_SIZE).to(tl.int64)
    rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    return (tl.load(k_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32)
            + tl.load(v_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32))


@triton.jit
def _gather_read_kernel(k_ptr, v_ptr, block_tables_ptr, out_ptr, stride_btr, stride_kb, stride_kt, stride_kh,
                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, TILES: tl.constexpr, EARLY_TILES: tl.constexpr, PDL: tl.constexpr):
    """K's and V's addresses are formed apart (_tile_sum): with one sum of offsets shared by
    both, the kernel took 97 registers a thread instead of 118 and 18.6 us instead of 17.3 at
    256 x 512 keys (H200)."""
    pair = tl.program_id(0)
    seq, kv_head = pair // NUM_KV_HEADS, pair % NUM_KV_HEADS
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btr
    total = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for tile in tl.static_range(EARLY_TILES):
        total += _tile_sum(k_ptr, v_ptr, block_table_row, tile * BLOCK_N, kv_head, offs_n, offs_d, stride_kb,
                           stride_kt, stride_kh, BLOCK_SIZE)
    await_previous_kernel(PDL)
    for tile in tl.static_range(EARLY_TILES, TILES):
        total += _tile_sum(k_ptr, v_ptr, block_table_row, tile * BLOCK_N, kv_head, offs_n, offs_d, stride_kb,
                           stride_kt, stride_kh, BLOCK_SIZE)
    tl.store(out_ptr + pair * HEAD_DIM + offs_d, tl.sum(total, 0))


def gather_read(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, keys: int,
                block_n: int = 64, early_tiles: int = 2, num_warps: int = 4) -> torch.Tensor:
    """[sequences x kv heads, head dim] fp32: each sequence's first `keys` keys and values of
    each kv head, summed over keys. Caches [blocks, block size, kv heads, head dim], the head
    dim contiguous and K and V strided alike; `keys` a multiple of block_n, every sequence
    holding at least that many."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if keys % block_n or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("gather_read: keys must be a multiple of block_n, the head dim contiguous, "
                         "K and V strided alike")
    pairs = block_tables.shape[0] * num_kv_heads
    out = torch.empty(pairs, head_dim, dtype=torch.float32, device=k_cache.device)
    _gather_read_kernel[(pairs,)](
        k_cache, v_cache, block_tables, out, block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        TILES=keys // block_n, EARLY_TILES=min(early_tiles, keys // block_n), num_warps=num_warps,
        **dependent_launch(k_cache.get_device()))
    return out
