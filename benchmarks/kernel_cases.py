"""The kernel cases that test_custom_kernels.py checks and times, and its float64 correctness
grid. Each Op names a public kernel function, its PyTorch reference, the expression a model
would write in plain PyTorch (eager, and what torch.compile gets), and a maker of one call's
inputs with the bytes that call must move. The grid runs both backends (the Triton kernels
through the public API, and the references) against float64 over shapes, dtypes and layouts
(contiguous, and strided views such as slices of a packed qkv output); tests/kernels/test_grid.py
runs a bounded grid under pytest."""
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from nanovllm.kernels import (apply_rotary_emb, backend_for, element_wise_mul_add, fused_add_gelu, fused_add_rms_norm,
                              gelu_and_mul, qk_norm_rope_store, reference, rms_norm, silu_and_mul, store_kvcache)
from nanovllm.utils.timing import clone_arguments


# Relative error ||out - ref|| / ||ref|| allowed against the float64 reference: a few units of
# the output dtype's rounding (fp32 also absorbs the GPU's approximate exp/rsqrt).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EPS = 1e-6
HEAD_DIM = 128
PREFILL_ROWS = 4096  # batches this large are prefills: never padded
BLOCK_SIZE = 16  # paged-cache block
SENTINEL = -777.0  # cache poison: slots nobody writes must keep it


@dataclass
class Case:
    """Inputs of one call, and the bytes it must move: inputs read once, outputs written once."""
    args: list
    bytes_moved: int


@dataclass
class Op:
    name: str
    fused: Callable
    ref: Callable
    eager: Callable  # what a model would write in plain PyTorch; torch.compile gets the same
    make: Callable  # (rows, width, dtype, device, strided) -> Case
    bench: tuple  # (width, strided) shapes to time, each at every row count
    # the tensors a call produces, from its result and its (possibly updated) arguments
    outputs: Callable = lambda result, args: result if isinstance(result, tuple) else (result,)
    exact: bool = False  # a copy: must match to the bit


def _randn(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def _rows_of(rows, width, dtype, device, strided):
    """[rows, width]: contiguous, or a slice of a wider buffer (row stride != width)."""
    if not strided:
        return _randn(rows, width, dtype=dtype, device=device)
    return _randn(rows, width + 96, dtype=dtype, device=device)[:, 32:32 + width]


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _make_gated(rows, width, dtype, device, strided):
    x = _rows_of(rows, width, dtype, device, strided)
    return Case([x], _nbytes(x) * 3 // 2)


def _make_add_gelu(rows, width, dtype, device, strided):
    x = _rows_of(rows, width, dtype, device, strided)
    bias = _randn(width, dtype=dtype, device=device)
    return Case([x, bias], 2 * _nbytes(x) + _nbytes(bias))


def _make_mul_add(rows, width, dtype, device, strided):
    a, c = (_rows_of(rows, width, dtype, device, strided) for _ in range(2))
    b = _randn(rows, width, dtype=dtype, device=device)
    return Case([a, b, c], 4 * _nbytes(a))


def _make_rms_norm(rows, width, dtype, device, strided):
    """Strided: Qwen3's q norm, [T, H, 128] heads of a packed qkv row of H + 2 heads."""
    weight = _randn(HEAD_DIM if strided else width, dtype=dtype, device=device)
    if strided:
        heads = max(1, width // HEAD_DIM)
        x = _randn(rows, (heads + 2) * HEAD_DIM, dtype=dtype, device=device)[:, :heads * HEAD_DIM]
        x = x.view(rows, heads, HEAD_DIM)
    else:
        x = _randn(rows, width, dtype=dtype, device=device)
    return Case([x, weight, EPS], 2 * _nbytes(x) + _nbytes(weight))


def _make_add_rms_norm(rows, width, dtype, device, strided):
    x = _rows_of(rows, width, dtype, device, strided)
    residual = _randn(rows, width, dtype=dtype, device=device)
    weight = _randn(width, dtype=dtype, device=device)
    return Case([x, residual, weight, EPS], 4 * _nbytes(x) + _nbytes(weight))


def _heads(width):
    """Attention heads for a model of hidden size `width`: (q heads, kv heads)."""
    q_heads = max(1, width // HEAD_DIM)
    return q_heads, max(1, q_heads // 2)


def _qkv(rows, width, dtype, device, strided):
    """q [T, Hq, D], k and v [T, Hk, D]: views of one packed projection output, or separate."""
    q_heads, kv_heads = _heads(width)
    if not strided:
        return [_randn(rows, h, HEAD_DIM, dtype=dtype, device=device) for h in (q_heads, kv_heads, kv_heads)]
    packed = _randn(rows, q_heads + 2 * kv_heads, HEAD_DIM, dtype=dtype, device=device)
    return list(packed.split([q_heads, kv_heads, kv_heads], dim=1))


def _positions_and_cos_sin(rows, device):
    max_position = 4096
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(max_position, device=device, dtype=torch.float32), inv_freq)
    return torch.randint(0, max_position, (rows,), device=device), torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotary_bytes(positions, cos_sin) -> int:
    """Positions, and the cos/sin rows they pick, each read once: a position that recurs in
    the batch reads its row from cache."""
    return _nbytes(positions) + positions.unique().numel() * cos_sin.shape[1] * cos_sin.element_size()


def _caches_and_slots(key, strided):
    """Key and value caches poisoned with SENTINEL, twice the slots the tokens need, a slot a
    token at random, and the number of tokens with a slot. strided, below prefill sizes: a
    decode batch padded as for a CUDA graph, whose last fifth of tokens has no slot."""
    rows, num_blocks = key.shape[0], 2 * math.ceil(key.shape[0] / BLOCK_SIZE)
    k_cache = torch.full((num_blocks, BLOCK_SIZE, *key.shape[1:]), SENTINEL, dtype=key.dtype, device=key.device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=key.device)[:rows]
    slotted = rows - rows // 5 if strided and rows < PREFILL_ROWS else rows
    slots[slotted:] = -1
    return k_cache, k_cache.clone(), slots, slotted


def _make_rotary(rows, width, dtype, device, strided):
    q, k, _ = _qkv(rows, width, dtype, device, strided)
    positions, cos_sin = _positions_and_cos_sin(rows, device)
    return Case([positions, q, k, cos_sin], 2 * _nbytes(q, k) + _rotary_bytes(positions, cos_sin))


def _make_kvcache(rows, width, dtype, device, strided):
    _, key, value = _qkv(rows, width, dtype, device, strided)
    k_cache, v_cache, slots, slotted = _caches_and_slots(key, strided)
    # a token without a slot needs neither its key and value read nor anything written
    return Case([key, value, k_cache, v_cache, slots], 2 * _nbytes(key, value) * slotted // rows + _nbytes(slots))


def _eager_store_kvcache(key, value, k_cache, v_cache, slots):
    """Plain PyTorch without the -1 filter (a boolean mask would synchronise with the host)."""
    k_cache.view(-1, *key.shape[1:])[slots] = key
    v_cache.view(-1, *value.shape[1:])[slots] = value


def _make_qk_norm_rope(rows, width, dtype, device, strided):
    """Everything between the qkv projection and attention; strided: q, k and v view one packed
    output, as in the model."""
    q, k, v = _qkv(rows, width, dtype, device, strided)
    positions, cos_sin = _positions_and_cos_sin(rows, device)
    k_cache, v_cache, slots, slotted = _caches_and_slots(k, strided)
    weights = [_randn(HEAD_DIM, dtype=dtype, device=device) for _ in range(2)]
    moved = 2 * _nbytes(q) + 2 * _nbytes(k, v) * slotted // rows + _rotary_bytes(positions, cos_sin) + _nbytes(slots)
    return Case([q, k, v, positions, cos_sin, k_cache, v_cache, slots, *weights], moved)


def _eager_qk_norm_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_weight, k_weight):
    """The rotated q comes back as a new tensor, the same bytes as the fused op's in-place
    write: torch.compile (2.11, 2.13) fails on a write into q while k and v view its buffer."""
    q_rotated, k_rotated = reference.apply_rotary_emb(positions, reference.rms_norm(q, q_weight, EPS),
                                                      reference.rms_norm(k, k_weight, EPS), cos_sin)
    _eager_store_kvcache(k_rotated, v, k_cache, v_cache, slots)
    return q_rotated


def _eager_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _eager_gelu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# Timed shapes follow Qwen3-0.6B (hidden 1024, MLP 3072, 16 q / 8 kv heads of 128) and a
# 4096-wide model; "strided" rms_norm is the per-head q norm on a slice of the qkv output.
OPS = [
    Op("silu_and_mul", silu_and_mul, reference.silu_and_mul, _eager_silu_and_mul, _make_gated,
       bench=((2 * 3072, False),)),
    Op("gelu_and_mul", gelu_and_mul, reference.gelu_and_mul, _eager_gelu_and_mul, _make_gated,
       bench=((2 * 3072, False),)),
    Op("fused_add_gelu", fused_add_gelu, reference.fused_add_gelu,
       lambda x, bias: F.gelu(x + bias, approximate="tanh"), _make_add_gelu, bench=((4096, False),)),
    Op("element_wise_mul_add", element_wise_mul_add, reference.element_wise_mul_add,
       lambda a, b, c: a * b + c, _make_mul_add, bench=((4096, False),)),
    Op("rms_norm", rms_norm, reference.rms_norm, reference.rms_norm, _make_rms_norm,
       bench=((1024, False), (4096, False), (2048, True))),
    Op("fused_add_rms_norm", fused_add_rms_norm, reference.fused_add_rms_norm, reference.fused_add_rms_norm,
       _make_add_rms_norm, bench=((1024, False), (4096, False))),
    Op("apply_rotary_emb", apply_rotary_emb, reference.apply_rotary_emb, reference.apply_rotary_emb,
       _make_rotary, bench=((2048, True),)),
    Op("store_kvcache", store_kvcache, reference.store_kvcache, _eager_store_kvcache, _make_kvcache,
       bench=((2048, True),), outputs=lambda result, args: (args[2], args[3]), exact=True),
    Op("qk_norm_rope_store", lambda *args: qk_norm_rope_store(*args, eps=EPS),
       lambda *args: reference.qk_norm_rope_store(*args, eps=EPS), _eager_qk_norm_rope, _make_qk_norm_rope,
       bench=((2048, True),), outputs=lambda result, args: (result, args[5], args[6])),
]


def _upcast(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 0 else diff


def check_case(op: Op, fn: Callable, case: Case, dtype: torch.dtype) -> float:
    """Worst relative error of fn's outputs against the float64 reference (inf for an output
    of the wrong dtype). Inputs are copied first, layouts kept: several ops consume them in place."""
    ref_args = [_upcast(a) for a in case.args]
    expected = op.outputs(op.ref(*ref_args), ref_args)
    args, _ = clone_arguments(case.args)
    got = op.outputs(fn(*args), args)
    if any(g.dtype != dtype for g in got):
        return math.inf
    return max(relative_error(g, e) for g, e in zip(got, expected))


def correctness_grid(device: torch.device, quick: bool):
    """(rows, widths, dtypes) for the device: the full grid on a GPU, a smaller one where the
    interpreter or the references run on the CPU."""
    if device.type == "cuda":
        rows = (1, 64, 256, 4096) if quick else (1, 64, 256, 4096, 32768)
        widths = (1024, 4096, 4095) if quick else (1024, 2048, 4096, 2 * 3072, 8192, 4095, 200)
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
    elif backend_for(device) == "triton":  # the interpreter: about 1 ms a program
        rows = (1, 7) if quick else (1, 7, 33)
        widths = (200, 1024) if quick else (200, 1024, 4095)
        dtypes = (torch.float32, torch.bfloat16)
    else:
        rows = (1, 7, 64) if quick else (1, 7, 64, 4096)
        widths = (200, 1024, 4095) if quick else (200, 1024, 2048, 4095, 2 * 3072)
        dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return rows, widths, dtypes


def _gated_width(op: Op, width: int) -> int:
    """Gated ops split the last dimension in two halves: an odd width means 2 * width."""
    return 2 * width if op.make is _make_gated and width % 2 else width


def _cases(op: Op, device: torch.device, dtype: torch.dtype, rows_grid, widths):
    """(label, fresh random Case) over the grid, contiguous and strided."""
    for rows in rows_grid:
        for width in map(lambda w: _gated_width(op, w), widths):
            for strided in (False, True):
                torch.manual_seed(rows * 7919 + width)
                yield f"{rows}x{width}{' strided' if strided else ''}", op.make(rows, width, dtype, device, strided)


def run_correctness(device: torch.device, grid: tuple, backends: dict, ops=OPS):
    """Every op of `ops` over grid = (rows, widths, dtypes), contiguous and strided, for each
    backend (name -> function of the Op giving the callable to check). -> (one record per
    case and backend, the number of mismatches)."""
    rows_grid, widths, dtypes = grid
    print(f"correctness: rows {rows_grid}, widths {widths}, dtypes {[str(d)[6:] for d in dtypes]}, "
          f"layouts contiguous/strided, backends {list(backends)}")
    records = []
    for op in ops:
        for dtype in dtypes:
            tolerance = 0.0 if op.exact else TOLERANCE[dtype]
            started, first = time.perf_counter(), len(records)
            for shape, case in _cases(op, device, dtype, rows_grid, widths):
                for name, pick in backends.items():
                    error = check_case(op, pick(op), case, dtype)
                    records.append(dict(op=op.name, dtype=str(dtype)[6:], backend=name, shape=shape,
                                        rel_error=error, tolerance=tolerance, ok=error <= tolerance))
                    if error > tolerance:
                        print(f"  FAIL {op.name} {name} {dtype} {shape}: rel error {error:.3e} > {tolerance:.0e}")
            seconds = time.perf_counter() - started
            for name in backends:
                worst = max((r for r in records[first:] if r["backend"] == name), key=lambda r: r["rel_error"])
                print(f"  {op.name:22s} {str(dtype)[6:]:9s} {name:7s} worst {worst['rel_error']:.2e} at "
                      f"{worst['shape']}  (tol {tolerance:.0e}, {seconds:.1f}s)")
    return records, sum(not r["ok"] for r in records)



def correctness_summary(records) -> list[dict]:
    """One row per (op, dtype, backend): cases, worst relative error, tolerance, mismatches."""
    groups = {}
    for r in records:
        groups.setdefault((r["op"], r["dtype"], r["backend"]), []).append(r)
    return [dict(op=op, dtype=dtype, backend=backend, cases=len(rs), worst_rel_error=max(r["rel_error"] for r in rs),
                 tolerance=rs[0]["tolerance"], mismatches=sum(not r["ok"] for r in rs))
            for (op, dtype, backend), rs in groups.items()]
