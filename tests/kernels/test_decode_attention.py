"""qk_norm_rope_attention (q/k norm, rotary, the KV write and split attention; one kernel for
decode steps of a few sequences) against the float64 composition of the references,
qk_norm_rope_store then paged_attention (tolerances per dtype in test_attention.TOLERANCE):
fp32 through Triton's interpreter (whose bf16 dots are not the GPU's), every dtype on a GPU.
The cache slot of each step's key starts as NaN, as does every slot no sequence owns: a read
of the step's key from the cache, or of any key outside a sequence, shows up."""
import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import FP32_INTERPRETER_AND_GPU, capture_and_replay, require_triton
from test_attention import MIXED, Case, assert_close, expected, make_case
from test_rotary import cos_sin_cache, packed_qkv

from nanovllm import kernels
from nanovllm.kernels import reference

try:
    from nanovllm.kernels import decode_attention
except ImportError:  # no Triton here: only the reference can run
    decode_attention = None

# Decode batch as the engine pads it for a CUDA graph (seq_len 0 rows of one query each); a
# sequence whose one key is the step's own; one whose last split (of 64-key tiles) holds only it.
DECODE = [300, 0, 17, 1, 65]


def _decode_step(keys, heads, head_dim, block_size, dtype, device, window=None, qk_norm=True, seed=0):
    """(case, qkv inputs, slot_mapping): sequence i has keys[i] keys, the last of which the
    step brings as packed-qkv views; the cache holds the others."""
    case = make_case([(1, n) for n in keys], heads, head_dim, block_size, dtype, device, spare_columns=3,
                     sliding_window=window, seed=seed)
    slots = [int(case.block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
             for i, n in enumerate(keys)]
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[slot_mapping[slot_mapping >= 0]] = float("nan")
    _, q, k, v = packed_qkv(len(keys), *heads, head_dim, dtype, device)
    positions = (case.seq_lens - 1).clamp_min(0)
    weights = dict(q_weight=torch.randn(head_dim, dtype=dtype, device=device) * 0.5 + 1,
                   k_weight=torch.randn(head_dim, dtype=dtype, device=device) * 0.5 + 1) if qk_norm else {}
    return case, (q, k, v, positions, cos_sin_cache(head_dim, device)), slot_mapping, weights


def _check(case: Case, qkv_inputs, slot_mapping, weights, **launcher_kwargs) -> torch.Tensor:
    """Output and caches against the reference; the caches change only at the step's slots,
    k and v not at all."""
    q, k, v, positions, cos_sin = qkv_inputs
    caches = [c.double() for c in (case.k_cache, case.v_cache)]
    q_rotated = reference.qk_norm_rope_store(q.double(), k.double(), v.double(), positions, cos_sin.double(),
                                             *caches, slot_mapping, *(w.double() for w in weights.values()), eps=1e-6)
    want = expected(Case(q_rotated, *caches, *(getattr(case, f) for f in (
        "cu_seqlens_q", "seq_lens", "block_tables", "max_seqlen_q", "scale", "causal", "sliding_window"))))
    before = [c.clone() for c in (case.k_cache, case.v_cache, k, v)]
    args = (q, k, v, positions, cos_sin, case.k_cache, case.v_cache, slot_mapping)
    kwargs = {n: val for n, val in case.kwargs().items() if n != "causal"} | weights | {"eps": 1e-6}
    if launcher_kwargs:
        out = decode_attention.qk_norm_rope_attention(*args, **kwargs, **launcher_kwargs)
    else:
        out = kernels.qk_norm_rope_attention(*args, **kwargs)
    assert_close(out, want, case.q.dtype)
    written = slot_mapping[slot_mapping >= 0]
    for cache, cache_before, cache_want in zip((case.k_cache, case.v_cache), before, caches):
        flat, flat_before = cache.flatten(0, 1), cache_before.flatten(0, 1)
        assert_close(flat[written], cache_want.flatten(0, 1)[written], case.q.dtype)
        others = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
        others[written] = False
        assert torch.equal(flat[others].isnan(), flat_before[others].isnan())
        assert torch.equal(flat[others].nan_to_num(), flat_before[others].nan_to_num())
    assert torch.equal(k, before[2]) and torch.equal(v, before[3])
    return out


def _fails(path: str):
    def call(*args, **kwargs):
        raise AssertionError(f"took {path}")
    return call


@pytest.fixture
def fused_only(monkeypatch):
    """Fails the call if it takes the two kernels: the case must run the fused decode kernel."""
    monkeypatch.setattr(decode_attention, "qk_norm_rope_store", _fails("the two kernels"))


@pytest.fixture
def unfused_only(monkeypatch):
    monkeypatch.setattr(decode_attention, "_decode", _fails("the fused kernel"))


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
@pytest.mark.parametrize("heads,head_dim,block_size", [((16, 8), 128, 16), ((5, 1), 96, 64), ((4, 2), 64, 128)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_matches_the_composition(fused_only, device, dtype, heads, head_dim, block_size, qk_norm,
                                        num_splits):
    """5 over 1: an odd GQA group; head_dim 96: a rotary half of 48, padded to 64; blocks of
    16 under 64-key tiles: a tile spans blocks. Two splits of the 300 keys: 192, three tiles,
    then 108, a tile and a tail; three: 128, 128 and 44."""
    require_triton(device)
    step = _decode_step(DECODE, heads, head_dim, block_size, dtype, device, qk_norm=qk_norm)
    out = _check(*step, num_splits=num_splits)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
@pytest.mark.parametrize("window", [70, 200])
def test_sliding_window(fused_only, device, dtype, window):
    """Windows that start inside a key tile and a cache block, over more than one tile (a
    window of at most one tile leaves nothing to split: the two kernels serve it)."""
    require_triton(device)
    _check(*_decode_step(DECODE, (8, 2), 64, 16, dtype, device, window=window), num_splits=4)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU[:2])
def test_one_sequence_splits_itself(fused_only, device, dtype):
    """The engine's batch-1 step: no forced split count, the plan spreads 1,000 keys."""
    require_triton(device)
    # the interpreter's grid counts 4 SMs (attention._multiprocessor_count): one kv head to split
    heads, block_size = ((16, 8), 128) if device == "cuda" else ((4, 1), 16)
    _check(*_decode_step([1000], heads, 128, block_size, dtype, device))


def _table_before_a_guard_page(table: torch.Tensor):
    """A copy of the int32 table whose last entry ends a page, the next page unreadable: a
    read past the table ends the process (SIGSEGV). -> (copy, the mapping that keeps it)."""
    page = mmap.PAGESIZE
    mapping = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    guard = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + page
    if libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(page), 0) != 0:  # 0: PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect")
    first_page = torch.frombuffer(mapping, dtype=torch.int32, count=page // 4)
    copy = first_page[page // 4 - table.numel():].view(table.shape)
    copy.copy_(table)
    return copy, mapping


def run_against_a_guard_page() -> None:
    """One sequence of 300 keys in blocks of 64, four splits of two 64-key tiles: the fourth
    starts at key 384, block-table column 6 of a table of 5 columns (no spare ones). Its first
    tile is loaded before the split sees it has no keys, so it must take its addresses from
    key 0."""
    decode_attention.qk_norm_rope_store = _fails("the two kernels")
    case, *rest = _decode_step([300], (4, 2), 64, 64, torch.float32, "cpu")
    case.block_tables, mapping = _table_before_a_guard_page(case.block_tables[:, :5].contiguous())
    _check(case, *rest, num_splits=4)


@pytest.mark.triton_interpret
def test_a_split_past_the_table_reads_no_column_past_it():
    """run_against_a_guard_page in a child process under the interpreter, so that a read past
    the table fails this test instead of ending the test run."""
    child = subprocess.run([sys.executable, "-c", "import test_decode_attention as t; t.run_against_a_guard_page()"],
                           cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600,
                           env=os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU[:2])
@pytest.mark.parametrize("shape,num_splits", [(MIXED, None), ([(1, n) for n in DECODE if n], 1), (None, None)],
                         ids=["mixed", "unsplit-decode", "decode-split-4-ways"])
def test_other_steps_take_the_two_kernels(unfused_only, device, dtype, shape, num_splits):
    """Prefill and mixed steps, and decode steps split fewer than _MIN_SPLITS ways, run
    qk_norm_rope_store then paged attention. The plan splits 4 ways one sequence of 2 kv heads
    in the interpreter (which counts 4 SMs), 17 sequences on a 132-SM GPU."""
    require_triton(device)
    if shape is None:
        shape = [(1, 300)] * (1 if device == "cpu" else 17)
    case = make_case(shape, (8, 2), 64, 16, dtype, device)
    tokens = case.q.shape[0]
    # each sequence's new tokens are its last ones: their slots, poisoned first
    tables = case.block_tables.cpu().long()
    slots = torch.cat([(tables[i].repeat_interleave(16)[:n] * 16 + torch.arange(n) % 16)[n - rows:]
                       for i, (rows, n) in enumerate(shape)]).to(device)
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    _, q, k, v = packed_qkv(tokens, 8, 2, 64, dtype, device)
    positions = torch.cat([torch.arange(n - rows, n) for rows, n in shape]).to(device)
    _check(case, (q, k, v, positions, cos_sin_cache(64, device)), slots, {},
           **({"num_splits": num_splits} if num_splits else {}))


@pytest.mark.gpu
def test_cuda_graph_capture():
    case, qkv_inputs, slot_mapping, weights = _decode_step([1000, 3], (16, 8), 128, 128, torch.bfloat16, "cuda")
    q, k, v, positions, cos_sin = qkv_inputs
    fresh_caches = [c.clone() for c in (case.k_cache, case.v_cache)]

    def step():
        case.k_cache.copy_(fresh_caches[0])
        case.v_cache.copy_(fresh_caches[1])
        return kernels.qk_norm_rope_attention(
            q, k, v, positions, cos_sin, case.k_cache, case.v_cache, slot_mapping,
            **{n: val for n, val in case.kwargs().items() if n != "causal"}, **weights)

    eager = step().clone()
    assert torch.equal(capture_and_replay(step), eager)


@pytest.mark.parametrize("field,change", [("slot_mapping", "short slots"), ("scale", "zero scale"),
                                          ("k_weight", "q weight alone")])
def test_bad_arguments_name_the_field(field, change):
    case, (q, k, v, positions, cos_sin), slot_mapping, weights = _decode_step([5, 9], (4, 2), 64, 16, torch.float32,
                                                                              "cpu")
    kwargs = {n: val for n, val in case.kwargs().items() if n != "causal"} | weights
    if change == "short slots":
        slot_mapping = slot_mapping[:1]
    elif change == "zero scale":
        kwargs["scale"] = 0.0
    else:
        del kwargs["k_weight"]
    with pytest.raises(ValueError, match=field):
        kernels.qk_norm_rope_attention(q, k, v, positions, cos_sin, case.k_cache, case.v_cache, slot_mapping,
                                       **kwargs)
