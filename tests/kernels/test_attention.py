"""Triton paged attention against the PyTorch reference in float64: in fp32 through Triton's
interpreter on the CPU, in bf16/fp16 on a GPU. Caches start as NaN and padding block-table
entries hold -1 or out-of-range ids, so any read outside a sequence's keys shows up."""
import math
import os
from dataclasses import dataclass

import pytest
import torch

import nanovllm.kernels as kernels
from nanovllm.kernels import reference
from nanovllm.utils.timing import capture

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
try:
    from nanovllm.kernels import attention
except ImportError:  # no Triton here: only the reference can run
    attention = None

interpret = pytest.mark.triton_interpret
gpu = pytest.mark.gpu

# (query rows, keys) per sequence: decode, short prefill chunk over a cache, long chunk over a
# cache, a single token, fresh prompt.
MIXED = [(1, 1328), (5, 18), (129, 463), (1, 1), (64, 64)]
HEADS = [(4, 4), (8, 2), (5, 1), (16, 8)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    scale: float
    causal: bool = True
    sliding_window: int | None = None

    def kwargs(self) -> dict:
        return dict(cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, block_tables=self.block_tables,
                    max_seqlen_q=self.max_seqlen_q, scale=self.scale, causal=self.causal,
                    sliding_window=self.sliding_window)


def make_case(shape, heads=(4, 2), head_dim=64, block_size=16, dtype=torch.float32, device="cpu", causal=True,
              spare_blocks=5, spare_columns=2, first_block=0, num_blocks=None, seed=0, sliding_window=None) -> Case:
    """Sequences of (query rows, keys); their blocks a random permutation of the cache from
    `first_block` on. Cache slots no sequence owns stay NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    blocks_per_seq = [math.ceil(keys / block_size) for _, keys in shape]
    used = sum(blocks_per_seq)
    num_blocks = num_blocks or first_block + used + spare_blocks
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    ids = first_block + torch.randperm(num_blocks - first_block, generator=gen)[:used]
    width = max(blocks_per_seq) + spare_columns
    block_tables = torch.empty(len(shape), width, dtype=torch.int32)
    for i in range(len(shape)):  # padding: -1 in even rows, ids past the cache in odd ones
        block_tables[i] = -1 if i % 2 == 0 else num_blocks + 1000 + i
    taken = 0
    for i, (_, keys) in enumerate(shape):
        row = ids[taken:taken + blocks_per_seq[i]]
        taken += blocks_per_seq[i]
        block_tables[i, :len(row)] = row.to(torch.int32)
        slots = (row.repeat_interleave(block_size) * block_size + torch.arange(len(row) * block_size) % block_size)
        slots = slots[:keys].to(device)
        for cache in (k_cache, v_cache):
            values = torch.randn(keys, num_kv_heads, head_dim, generator=gen)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values.to(device=device, dtype=dtype)
    query_lens = torch.tensor([rows for rows, _ in shape])
    cu_seqlens_q = torch.zeros(len(shape) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = query_lens.cumsum(0)
    q = torch.randn(int(cu_seqlens_q[-1]), num_q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return Case(q, k_cache, v_cache, cu_seqlens_q.to(device), torch.tensor([k for _, k in shape], dtype=torch.int32,
                device=device), block_tables.to(device), max(rows for rows, _ in shape), head_dim ** -0.5, causal,
                sliding_window)


def expected(case: Case) -> torch.Tensor:
    """The reference in float64 over a compact copy of only the blocks the sequences own."""
    block_size = case.k_cache.shape[1]
    lens = case.seq_lens.tolist()
    owned = [case.block_tables[i, :math.ceil(n / block_size)].long() for i, n in enumerate(lens)]
    ids = torch.cat(owned) if owned else torch.zeros(0, dtype=torch.long, device=case.q.device)
    tables = torch.zeros_like(case.block_tables)
    taken = 0
    for i, row in enumerate(owned):
        tables[i, :len(row)] = torch.arange(taken, taken + len(row), dtype=tables.dtype, device=tables.device)
        taken += len(row)
    k, v = (c.index_select(0, ids).double() for c in (case.k_cache, case.v_cache))
    kwargs = case.kwargs() | {"block_tables": tables}
    return reference.paged_attention(case.q.double(), k, v, **kwargs)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.3e} over {TOLERANCE[dtype]:.0e}"


def run_public(case: Case) -> torch.Tensor:
    return kernels.paged_attention(case.q, case.k_cache, case.v_cache, **case.kwargs())


def check(case: Case, **launcher_kwargs) -> torch.Tensor:
    """Through the public entry point unless a launcher option is set."""
    launcher_kwargs = {k: v for k, v in launcher_kwargs.items() if v is not None}
    if launcher_kwargs:
        out = attention.paged_attention(case.q, case.k_cache, case.v_cache, **case.kwargs(), **launcher_kwargs)
    else:
        out = run_public(case)
    assert_close(out, expected(case), case.q.dtype)
    return out


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returning NaN-filled float tensors: outputs and split partials the kernels
    leave unwritten show up as NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


# --- CPU, through Triton's interpreter, fp32 --------------------------------------------------

@pytest.fixture
def interpreted():
    assert kernels.backend_for("cpu") == "triton", "the Triton kernel must run, not the PyTorch fallback"


@interpret
@pytest.mark.parametrize("heads,head_dim,block_size", [((4, 4), 64, 16), ((8, 2), 128, 32), ((5, 1), 80, 64),
                                                       ((16, 8), 16, 128)])
def test_mixed_batch_interpreted(interpreted, nan_empty, heads, head_dim, block_size):
    check(make_case(MIXED, heads, head_dim, block_size))


@interpret
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((5, 1), 96)])
def test_decode_interpreted(interpreted, nan_empty, num_splits, heads, head_dim):
    """Decode batch as the engine pads it for a CUDA graph: seq_len 0 rows of one query each."""
    case = make_case([(1, 300), (1, 0), (1, 17), (1, 0), (1, 64)], heads, head_dim, block_size=16, spare_columns=6)
    out = check(case, num_splits=num_splits)
    assert (out[[1, 3]] == 0).all()


@interpret
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_prefill_interpreted(interpreted, nan_empty, num_splits):
    """Split KV under query tiles: some splits lie wholly past a row's causal limit."""
    check(make_case([(40, 200), (3, 3), (1, 90)], (8, 2), 32, block_size=32), num_splits=num_splits)


@interpret
@pytest.mark.parametrize("num_splits", [1, 3])
def test_non_causal_interpreted(interpreted, nan_empty, num_splits):
    check(make_case([(7, 70), (20, 20), (1, 5)], (4, 2), 64, causal=False), num_splits=num_splits)


@interpret
def test_head_dim_256_interpreted(interpreted, nan_empty):
    check(make_case([(3, 300), (1, 40)], (2, 1), 256, block_size=256))


@interpret
def test_empty_sequences_interpreted(interpreted, nan_empty):
    """seq_len 0 rows give zeros; a sequence without query rows neither reads nor writes."""
    case = make_case([(2, 9), (0, 30), (1, 0), (4, 4)], (4, 2), 32)
    out = check(case)
    assert (out[2] == 0).all()


@interpret
def test_auto_split_interpreted(interpreted, nan_empty):
    """One long sequence on one kv head: the launcher splits it without being asked."""
    case = make_case([(1, 700)], (2, 1), 32, block_size=16)
    assert attention.split_plan(1, case.block_tables.shape[1] * 16, 64, torch.device("cpu"))[0] > 1
    check(case)


@interpret
@pytest.mark.parametrize("merge_per_thread", [None, 8])
def test_decode_padded_table_interpreted(interpreted, nan_empty, monkeypatch, merge_per_thread):
    """A decode graph's block table reaches far past its sequences: of 37 splits (not a power
    of two) of 16 keys, most are empty, write no partial (NaN here) and must not reach the
    output. 8 values a thread makes the merge take the splits 4 at a time."""
    if merge_per_thread:
        monkeypatch.setattr(attention, "_MERGE_PER_THREAD", merge_per_thread)
    case = make_case([(1, 40), (1, 0), (1, 150), (1, 17)], (4, 2), 64, block_size=16, spare_columns=27)
    assert attention.split_plan(8, case.block_tables.shape[1] * 16, 16, torch.device("cpu"), 37) == (37, 16)
    out = check(case, num_splits=37, config=attention.TileConfig(16, 16, 4, 1))
    assert (out[1] == 0).all()


@interpret
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,block_n", [(16, 32), (32, 32), (64, 16)])
def test_block_table_paths_interpreted(interpreted, nan_empty, num_splits, block_size, block_n):
    """A key tile inside one cache block (BLOCK_N <= block size, starting mid-block when
    smaller) loads one block id; a tile spanning blocks loads one per key."""
    case = make_case([(3, 100), (1, 77), (2, 2), (1, 0)], (4, 2), 32, block_size)
    check(case, num_splits=num_splits, config=attention.TileConfig(16, block_n, 4, 1))


@interpret
def test_split_decode_with_tma_key_tiles_interpreted(interpreted, nan_empty):
    """The split decode tiles over blocks of 128 keys: 128-key TMA tiles in each split, the
    splits' ragged ends gathered, empty splits skipped by the merge."""
    case = make_case([(1, 700), (1, 130), (1, 1)], (4, 2), 64, block_size=128, spare_columns=3)
    check(case, num_splits=4, config=attention.TileConfig(16, 128, 4, 1, tma=True))


@interpret
@pytest.mark.parametrize("block_size,block_n,head_dim,uses_tma", [(64, 32, 64, True), (32, 32, 32, True),
                                                                  (16, 32, 64, False), (64, 32, 80, False)])
def test_tma_key_tiles_interpreted(interpreted, nan_empty, monkeypatch, block_size, block_n, head_dim, uses_tma):
    """Full key tiles come by TMA descriptor where a tile lies in one cache block and the head
    dim needs no padding, and are gathered row by row elsewhere; tiles at a sequence's end or a
    causal limit always are (the NaN of unwritten slots would otherwise reach the output)."""
    made, real = [], attention._kv_descriptors

    def spy(*args):
        descriptors = real(*args)
        made.append(descriptors[0] is not None)
        return descriptors

    monkeypatch.setattr(attention, "_kv_descriptors", spy)
    case = make_case(MIXED, (8, 2), head_dim, block_size)
    check(case, num_splits=1, config=attention.TileConfig(32, block_n, 4, 1, tma=True))
    assert made == [uses_tma]


@interpret
@pytest.mark.parametrize("splits,merge_per_thread", [(2, None), (37, None), (37, 16)])
def test_merge_splits_interpreted(interpreted, monkeypatch, splits, merge_per_thread):
    """The merge alone: partials weighed by 2^lse, in tiles of 32 splits (head dim 80 padded to
    128) or, with 16 values a thread, 4. Empty splits (lse -inf) hold NaN partials, which must
    not reach the output; a (token, head) whose splits are all empty gets zeros."""
    if merge_per_thread:
        monkeypatch.setattr(attention, "_MERGE_PER_THREAD", merge_per_thread)
    gen = torch.Generator().manual_seed(0)
    tokens, heads, head_dim = 3, 2, 80
    partial = torch.randn(tokens, heads, splits, head_dim, generator=gen)
    lse = 8 * torch.randn(tokens, heads, splits, generator=gen)
    empty = torch.rand(tokens, heads, splits, generator=gen) < 0.6
    empty[0, 1] = True
    empty[1, 0, 0] = False
    partial[empty] = float("nan")
    lse[empty] = float("-inf")
    out = torch.full((tokens, heads + 1, head_dim), float("nan"))[:, 1:]  # a strided view, as out may be
    attention.merge_splits(partial, lse, out, attention.padded_head_dim(head_dim))
    weights = torch.where(empty, 0.0, torch.exp2(lse.double() - lse.amax(-1, keepdim=True).double()))
    ref = (weights[..., None] * partial.double().nan_to_num()).sum(2) / weights.sum(2, keepdim=True).clamp_min(1e-300)
    assert (out[0, 1] == 0).all()
    assert_close(out, ref, torch.float32)


def spy_launches(monkeypatch, *names) -> list:
    """Launches of the paged-attention kernel go on as before; each appends the values of its
    `names` keywords, as a tuple, to the list returned."""
    launched, kernel = [], attention._paged_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(tuple(kwargs[name] for name in names))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention, "_paged_attention_kernel", Spy())
    return launched


@interpret
@pytest.mark.parametrize("head_dim,max_seqlen_q,num_splits,preloads", [(64, 1, 1, True), (128, 1, 1, False),
                                                                        (64, 1, 3, False), (64, 2, 1, False)])
def test_decode_preloads_its_first_key_tile_interpreted(interpreted, nan_empty, monkeypatch, head_dim, max_seqlen_q,
                                                        num_splits, preloads):
    """Unsplit decode with heads of 64 or less loads its first key tile before the PDL wait: a
    sequence whose keys before this step fill it (300) takes it, one whose step key lies in
    that tile (17, 64: 128-key tiles) reads the tile in the loops. Heads of 128, split grids
    and steps with more than one query row never preload."""
    launched = spy_launches(monkeypatch, "PRELOAD")
    shape = [(1, 300), (1, 0), (1, 17), (max_seqlen_q, 64), (1, 129)]
    check(make_case(shape, (8, 2), head_dim, block_size=16, spare_columns=3), num_splits=num_splits)
    assert launched == [(preloads,)]


@interpret
def test_non_contiguous_q_interpreted(interpreted, nan_empty):
    """q as a view into a fused qkv projection output."""
    case = make_case(MIXED[1:], (4, 2), 32)
    qkv = torch.randn(case.q.shape[0], 8, 32)
    qkv[:, :4] = case.q
    case.q = qkv[:, :4]
    check(case)


@interpret
@pytest.mark.parametrize("heads,head_dim,block_size", [((14, 2), 64, 64), ((8, 4), 32, 128), ((14, 2), 64, 16)])
@pytest.mark.parametrize("num_seqs", [5, 3])
def test_decode_packs_small_kv_heads_interpreted(interpreted, nan_empty, monkeypatch, heads, head_dim, block_size,
                                                 num_seqs):
    """Kv heads whose keys fit one 128-wide row go to one program a sequence (each q row then
    scores only its own head's columns) where that still leaves a program an SM (4 under the
    interpreter) and blocks hold whole key tiles; otherwise a program a kv head. q is a strided
    view."""
    packed = []
    decide = attention._kv_heads_packed
    monkeypatch.setattr(attention, "_kv_heads_packed", lambda *args: packed.append(decide(*args)) or packed[-1])
    shape = [(1, 300), (1, 0), (1, 17), (1, 129), (1, 64)][:num_seqs]
    case = make_case(shape, heads, head_dim, block_size, spare_columns=3)
    wide = torch.randn(case.q.shape[0], heads[0], 2 * head_dim)
    wide[..., ::2] = case.q
    case.q = wide[..., ::2]
    check(case)
    assert packed == [heads[1] if num_seqs >= 4 and block_size >= 64 else 1]


# --- sliding window ---------------------------------------------------------------------------

# Decode far past the window, prefill chunks whose query tiles span more or less than the
# window, a single key, an empty sequence.
WINDOW_SHAPES = [(1, 1000), (5, 18), (70, 260), (1, 1), (1, 0), (33, 120)]


def poison_outside_window(case: Case) -> int:
    """Cache blocks wholly before the window of every query of their sequence become NaN, and
    their table entries name an unowned NaN block instead: a kernel that read either would
    output NaN. Returns how many entries were poisoned."""
    block_size = case.k_cache.shape[1]
    lens = case.seq_lens.tolist()
    owned = {int(b) for i, n in enumerate(lens) for b in case.block_tables[i, :math.ceil(n / block_size)]}
    unowned = next(b for b in range(case.k_cache.shape[0]) if b not in owned)
    query_lens = (case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).tolist()
    poisoned = 0
    for i, (rows, seq_len) in enumerate(zip(query_lens, lens)):
        first_key = max(seq_len - rows + 1 - case.sliding_window, 0)
        for j in range(first_key // block_size):
            for cache in (case.k_cache, case.v_cache):
                cache[case.block_tables[i, j]] = float("nan")
            case.block_tables[i, j] = unowned
            poisoned += 1
    return poisoned


def check_window(case: Case, **launcher_kwargs) -> None:
    want = expected(case)
    assert poison_outside_window(case) > 0, "no block lies outside the window: the case tests nothing"
    launcher_kwargs = {k: v for k, v in launcher_kwargs.items() if v is not None}
    if launcher_kwargs:
        out = attention.paged_attention(case.q, case.k_cache, case.v_cache, **case.kwargs(), **launcher_kwargs)
    else:
        out = run_public(case)
    assert_close(out, want, case.q.dtype)


@interpret
@pytest.mark.parametrize("window", [1, 37, 200])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_interpreted(interpreted, nan_empty, window, num_splits):
    """A query sees the `window` keys ending at its own position, in decode, prefill and mixed
    batches, split or not; the blocks before every query's window are never read."""
    check_window(make_case(WINDOW_SHAPES, (8, 2), 64, 16, sliding_window=window), num_splits=num_splits)


@interpret
@pytest.mark.parametrize("heads,head_dim,block_size,tile", [((8, 2), 64, 16, (16, 32, False)),
                                                            ((4, 2), 64, 64, (32, 32, True)),
                                                            ((5, 1), 80, 32, (128, 16, False))])
def test_sliding_window_tiles_interpreted(interpreted, nan_empty, heads, head_dim, block_size, tile):
    """Key tiles spanning cache blocks (the window's first tile starts in a block the window
    does not reach), TMA tiles inside every row's window, padded head dim with odd groups."""
    block_m, block_n, tma = tile
    case = make_case(WINDOW_SHAPES, heads, head_dim, block_size, sliding_window=45)
    check_window(case, num_splits=2, config=attention.TileConfig(block_m, block_n, 4, 1, tma=tma))


@interpret
def test_sliding_window_decode_batch_interpreted(interpreted, nan_empty, monkeypatch):
    """A decode graph's batch: a padding row of seq_len 0 and a wide block table. The launcher
    sizes its split from the window, not from the table's width, and the splits share out
    the window's keys only."""
    plans, real = [], attention.split_plan

    def spy(programs, max_kv, *args):
        plans.append((max_kv, real(programs, max_kv, *args)[0]))
        return real(programs, max_kv, *args)

    monkeypatch.setattr(attention, "split_plan", spy)
    case = make_case([(1, 700), (1, 0)], (2, 1), 64, 16, spare_columns=30, sliding_window=300)
    check_window(case)
    assert plans[-1] == (300, 3)


# --- host-side rules (no kernel runs) ---------------------------------------------------------

@pytest.mark.parametrize("field,change", [("scale", {"scale": 0.0}), ("scale", {"scale": -0.1}),
                                          ("max_seqlen_q", {"max_seqlen_q": 0}),
                                          ("k_cache", {"k_cache": torch.zeros(4, 24, 2, 32),
                                                       "v_cache": torch.zeros(4, 24, 2, 32)}),
                                          ("block_tables", {"block_tables": torch.zeros(1, 3, dtype=torch.int32)}),
                                          ("sliding_window", {"sliding_window": 0}),
                                          ("sliding_window", {"sliding_window": 8.0}),
                                          ("sliding_window", {"sliding_window": 8, "causal": False})])
def test_bad_arguments_name_their_field(field, change):
    case = make_case([(2, 9), (1, 30)], (4, 2), 32)
    caches = [change.get(name, getattr(case, name)) for name in ("k_cache", "v_cache")]
    kwargs = case.kwargs() | {k: v for k, v in change.items() if not k.endswith("_cache")}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        kernels.paged_attention(case.q, *caches, **kwargs)


@pytest.mark.skipif(attention is None, reason="needs Triton")
def test_split_plan(monkeypatch):
    monkeypatch.setattr(attention, "_multiprocessor_count", lambda device: 132)  # H100, H200
    device = torch.device("cpu")
    assert attention.split_plan(132, 32768, 64, device) == (1, 128)  # a full wave already
    # 1 x 32768, 8 kv heads: 2 programs per SM (33 splits), rounded down to a power of two
    assert attention.split_plan(8, 32768, 64, device) == (32, 128)
    assert attention.split_plan(8, 4000, 64, device) == (32, 128)  # no split under 128 keys
    assert attention.split_plan(8, 3000, 64, device) == (24, 128)
    assert attention.split_plan(64, 4096, 64, device) == (4, 128)
    assert attention.split_plan(1, 100, 64, device, num_splits=50) == (2, 64)  # forced: one key tile a split


@pytest.mark.skipif(attention is None, reason="needs Triton")
@pytest.mark.parametrize("programs,max_kv,block_n,forced", [(8, 32768, 64, None), (64, 4096, 64, None),
                                                            (3, 10000, 32, None), (1, 100, 16, 50), (4, 640, 64, 3)])
def test_splits_cover_every_sequence_length(monkeypatch, programs, max_kv, block_n, forced):
    """The kernel's keys per split (from seq_len) times the split count reaches every key."""
    monkeypatch.setattr(attention, "_multiprocessor_count", lambda device: 132)
    splits, min_partition = attention.split_plan(programs, max_kv, block_n, torch.device("cpu"), forced)
    assert min_partition % block_n == 0
    for seq_len in range(0, max_kv + 1, 7):
        partition = max(min_partition, -(-(-(-seq_len // splits)) // block_n) * block_n)
        assert splits * partition >= seq_len


@pytest.mark.skipif(attention is None, reason="needs Triton")
def test_out_of_shared_memory_falls_back_once(monkeypatch):
    """A config too big for the GPU's shared memory steps down, and later calls of the shape
    class start from the config that fitted."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(attention, "_fitted_configs", {})
    tried = []

    def launch(config, out, lse, split):
        tried.append(config)
        if config.num_stages > 1 or config.block_n > 32:
            raise OutOfResources(200_000, 100_000, "shared memory")

    config = attention.TileConfig(128, 64, 8, 3)
    for _ in range(2):
        attention._with_fallback(launch, config, None, None, False, ("class",))
    fitted = attention.TileConfig(128, 32, 8, 1)
    assert tried == [config, config._replace(num_stages=2), config._replace(num_stages=1), fitted, fitted]


# --- GPU, bf16/fp16 ---------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 64), ((8, 2), 128), ((5, 1), 80), ((16, 8), 128),
                                            ((32, 8), 96), ((4, 2), 256)])
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_mixed_batch_gpu(nan_empty, heads, head_dim, block_size):
    check(make_case(MIXED, heads, head_dim, block_size, torch.bfloat16, "cuda"))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_gpu(nan_empty, dtype):
    check(make_case(MIXED, (16, 8), 128, 32, dtype, "cuda"))


@gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_decode_gpu(nan_empty, num_splits, block_size):
    shape = [(1, n) for n in (1, 0, 4097, 33, 0, 1024, 250)]
    out = check(make_case(shape, (16, 8), 128, block_size, torch.bfloat16, "cuda", spare_columns=40),
                num_splits=num_splits)
    assert (out[[1, 4]] == 0).all()


@gpu
@pytest.mark.parametrize("block_size,prefetches", [(16, True), (128, False)])
def test_decode_small_heads_prefetch_next_tile_gpu(nan_empty, monkeypatch, block_size, prefetches):
    """Unsplit decode with heads of 64 preloads its first key tile; where tiles span several
    cache blocks it also requests the next tile's rows into L2, a hint that leaves the output
    as it is (sequences shorter than one tile, than two, and longer)."""
    launched = spy_launches(monkeypatch, "PRELOAD", "PREFETCH_NEXT")
    shape = [(1, n) for n in (1, 0, 129, 4097, 512, 33, 300, 200)]
    check(make_case(shape, (14, 2), 64, block_size, torch.bfloat16, "cuda", spare_columns=5), num_splits=1)
    assert launched == [(True, prefetches)]


@gpu
@pytest.mark.parametrize("heads,head_dim,block_size", [((14, 2), 64, 128), ((8, 2), 64, 64), ((12, 4), 32, 256)])
def test_decode_packed_kv_heads_gpu(nan_empty, heads, head_dim, block_size):
    """A decode batch of more sequences than SMs with small kv heads: one program a sequence."""
    shape = [(1, n) for n in ([1, 0, 4097, 33, 512, 1024, 250] * 24)]
    case = make_case(shape, heads, head_dim, block_size, torch.bfloat16, "cuda", spare_columns=4)
    assert attention._kv_heads_packed(case.k_cache, case.v_cache, heads[0], 1, len(shape), 1) == heads[1]
    out = check(case, cuda_decode=False)
    assert (out[1::7] == 0).all()


@gpu
@pytest.mark.parametrize("num_splits", [None, 4])
def test_long_prefill_chunks_gpu(nan_empty, num_splits):
    """Chunked prefill over a long cached prefix, next to decodes."""
    shape = [(512, 8192), (1, 3000), (300, 300), (1, 17)]
    check(make_case(shape, (16, 8), 128, 16, torch.bfloat16, "cuda"), num_splits=num_splits)


@gpu
@pytest.mark.parametrize("num_splits", [None, 3])
def test_cache_offsets_beyond_int32_gpu(num_splits):
    """Block id x block size x strides past 2^32 elements: the sequences own the last blocks of
    a ~20 GB cache pair."""
    num_blocks, block_size, heads, head_dim = 300_000, 16, (16, 8), 128
    block_elements = block_size * heads[1] * head_dim
    if torch.cuda.mem_get_info()[0] < 2 * num_blocks * block_elements * 2 + (4 << 30):
        pytest.skip("not enough free GPU memory for a >2^32-element cache pair")
    shape = [(1, 900), (40, 700), (1, 16)]
    used = sum(math.ceil(k / block_size) for _, k in shape)
    first_block = num_blocks - used
    assert first_block * block_elements > 2 ** 32
    case = make_case(shape, heads, head_dim, block_size, torch.bfloat16, "cuda", num_blocks=num_blocks,
                     first_block=first_block, spare_blocks=0)
    check(case, num_splits=num_splits)
    del case
    torch.cuda.empty_cache()


@gpu
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("block_size", [16, 128])
def test_sliding_window_gpu(nan_empty, num_splits, block_size):
    """Mistral's 4096-key window over long decodes and prefill chunks, next to short ones."""
    shape = [(1, 9000), (300, 4500), (1, 17), (1, 0), (700, 700), (1, 33000)]
    case = make_case(shape, (32, 8), 128, block_size, torch.bfloat16, "cuda", sliding_window=4096)
    check_window(case, num_splits=num_splits)


@gpu
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("batch", [4, 64])
def test_decode_cuda_graph_gpu(batch, window):
    """Capture one decode call, then replay it with new seq_lens, block tables and queries."""
    heads, head_dim, block_size, max_blocks = (16, 8), 128, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = batch * max_blocks
    k_cache, v_cache = (torch.randn(num_blocks, block_size, heads[1], head_dim, device="cuda", generator=gen,
                                    dtype=torch.bfloat16) for _ in range(2))
    q = torch.empty(batch, heads[0], head_dim, device="cuda", dtype=torch.bfloat16)
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.empty(batch, device="cuda", dtype=torch.int32)
    block_tables = torch.empty(batch, max_blocks, device="cuda", dtype=torch.int32)
    case = Case(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, 1, head_dim ** -0.5, sliding_window=window)

    def refill():
        lens = torch.randint(1, max_blocks * block_size + 1, (batch,), device="cuda", generator=gen)
        lens[batch // 2] = 0  # a padding row
        seq_lens.copy_(lens)
        block_tables.copy_(torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, max_blocks))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))

    refill()
    graph, out = capture(lambda: run_public(case))  # compiles in the warm-up, outside the capture
    for _ in range(3):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected(case), torch.bfloat16)
        assert (out[batch // 2] == 0).all()


def _compiled_variants() -> int:
    kernels = (attention._paged_attention_kernel, attention._merge_splits_kernel)
    return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())


@gpu
def test_new_token_counts_do_not_recompile_gpu():
    """Batch size, token count, sequence lengths and block-table width change every step."""
    try:
        _compiled_variants()
    except (AttributeError, TypeError, IndexError):
        pytest.skip("this Triton keeps its compiled-kernel cache elsewhere")
    # The first two pairs stay unsplit (over 132 programs, an H100's SMs). The split decodes
    # force 9 and 13 splits: one merge variant (BLOCK_S 16) whatever the GPU's SM count.
    prefill = [[(17, 40), (100, 100)] * 5, [(5, 300), (64, 64), (1, 9), (230, 230)] * 2]
    decode = [[(1, n) for n in range(100, 4000, 13)], [(1, n) for n in range(50, 9000, 31)]]
    split_decode = [[(1, 5000)] * 3, [(1, 7000), (1, 20)] * 2]
    for shapes, splits in ((prefill, (None, None)), (decode, (None, None)), (split_decode, (9, 13))):
        check(make_case(shapes[0], (16, 8), 128, 16, torch.bfloat16, "cuda"), num_splits=splits[0])
        before = _compiled_variants()
        check(make_case(shapes[1], (16, 8), 128, 16, torch.bfloat16, "cuda", spare_columns=7), num_splits=splits[1])
        assert _compiled_variants() == before


@pytest.mark.skipif(attention is None, reason="needs Triton")
def test_split_decode_grids_pipeline_deeper():
    """Split decode grids leave shared memory for 5 stages, or 128-key TMA tiles over cache
    blocks of 128 keys or more; unsplit ones keep 3 stages (occupancy)."""
    cuda = torch.device("cuda")
    assert attention.default_config(128, 2, 1, torch.bfloat16, cuda).num_stages == 3
    assert attention.default_config(128, 2, 1, torch.bfloat16, cuda, split=True).num_stages == 5
    assert attention.default_config(256, 2, 1, torch.bfloat16, cuda, split=True).num_stages == 3
    tma_tiles = attention.TileConfig(16, 128, 4, 4, tma=True)
    assert attention.default_config(128, 2, 1, torch.bfloat16, cuda, True, 128) == tma_tiles
    assert attention.default_config(128, 2, 1, torch.bfloat16, cuda, True, 64).block_n == 64


# --- the CUDA C++ decode kernel (kernels/cuda/paged_decode.py), heads of 64 -------------------

def cuda_decode_module(required: bool = False):
    """(the launcher module, the built extension); without a build, a skip, or with `required`
    a failure."""
    from nanovllm.kernels.cuda import paged_decode
    ext = paged_decode.module()
    if ext is None:
        (pytest.fail if required else pytest.skip)("the CUDA C++ decode kernel did not build here")
    return paged_decode, ext


@gpu
@pytest.mark.parametrize("heads,block_size,dtype", [((14, 2), 16, torch.bfloat16), ((16, 1), 64, torch.bfloat16),
                                                    ((4, 4), 32, torch.float16), ((9, 1), 256, torch.bfloat16),
                                                    ((32, 8), 16, torch.float16), ((8, 8), 16, torch.bfloat16)])
def test_cuda_decode_gpu(nan_empty, heads, block_size, dtype):
    """With and without PDL, over sequences shorter than a chunk, of whole chunks, of a chunk and
    a key, longer than one warp's 32 block ids, empty, and without a query row this step."""
    paged_decode, ext = cuda_decode_module()
    shape = [(1, n) for n in (1, 0, 15, 16, 17, 129, 4097, 512, 33, 300)] + [(0, 40), (1, 9000)]
    case = make_case(shape, heads, 64, block_size, dtype, "cuda", spare_columns=3)
    assert paged_decode.supports(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                                 case.block_tables)
    ref = expected(case)
    for pdl in (False, True):
        out = paged_decode.paged_decode(ext, case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                                        case.block_tables, case.scale, 1.0, 1.0, pdl)
        assert_close(out, ref, dtype)
        assert (out[1] == 0).all()


@gpu
def test_cuda_decode_serves_unsplit_decode_only_gpu(nan_empty, monkeypatch):
    """paged_attention takes the CUDA kernel for unsplit decode grids of heads of 64 and Triton
    for split grids, prefill, windows, other head dims, caches strided along the head dim and
    forced tiles, all matching the reference; q may be a view into a wider qkv tensor."""
    paged_decode, _ = cuda_decode_module()
    served = []
    kernel = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *args, **kwargs: served.append(1) or kernel(*args, **kwargs))
    decode = [(1, n) for n in (1, 0, 129, 4097, 512, 33, 300, 200)] * 20  # 160 sequences x 2 kv heads: unsplit
    case = make_case(decode, (14, 2), 64, 16, torch.bfloat16, "cuda", spare_columns=5)
    qkv = torch.randn(case.q.shape[0], 18, 64, device="cuda", dtype=torch.bfloat16)
    qkv[:, :14] = case.q
    case.q = qkv[:, :14]
    check(case)
    assert served == [1]
    check(make_case(decode[:8], (14, 2), 64, 16, torch.bfloat16, "cuda"))  # split: 16 programs
    check(case, num_splits=1)  # forced: Triton's
    check(make_case(decode, (16, 8), 128, 16, torch.bfloat16, "cuda"))
    check(make_case(MIXED * 30, (14, 2), 64, 16, torch.bfloat16, "cuda"))
    check_window(make_case(decode, (14, 2), 64, 16, torch.bfloat16, "cuda", sliding_window=300))
    strided = make_case(decode, (14, 2), 64, 16, torch.bfloat16, "cuda")
    for name in ("k_cache", "v_cache"):
        cache = getattr(strided, name)
        wide = torch.empty(*cache.shape[:3], 128, device="cuda", dtype=cache.dtype)
        wide[..., ::2] = cache
        setattr(strided, name, wide[..., ::2])
    check(strided)
    assert served == [1]


@gpu
@pytest.mark.parametrize("keys", [[5, 17, 100, 128, 129], [700, 1000, 2000]])
def test_cuda_decode_reads_the_steps_own_key_after_the_wait_gpu(keys):
    """The kernel reads the keys earlier steps cached before its PDL wait and the step's own key
    after it: captured behind store_kvcache (which writes that key), each replay with new
    key values must see them. Short sequences put the step's key in a chunk issued before the
    wait, long ones in a later one."""
    paged_decode, _ = cuda_decode_module()
    batch = 160
    seq_lens_list = [keys[i % len(keys)] for i in range(batch)]
    case = make_case([(1, n) for n in seq_lens_list], (14, 2), 64, 16, torch.bfloat16, "cuda")
    block_tables = case.block_tables.long()
    last = case.seq_lens.long() - 1
    slot_mapping = block_tables.gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16
    new_k, new_v = (torch.empty(batch, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step():
        kernels.store_kvcache(new_k, new_v, case.k_cache, case.v_cache, slot_mapping)
        return run_public(case)

    gen = torch.Generator(device="cuda").manual_seed(1)
    for t in (new_k, new_v):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
    graph, out = capture(step)
    for _ in range(3):
        for t in (new_k, new_v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen) * 4)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected(case), torch.bfloat16)
