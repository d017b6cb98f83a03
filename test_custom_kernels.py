"""Checks and measures every custom kernel.

    python test_custom_kernels.py [--out DIR] [--quick]

1. Correctness of both backends (the Triton kernels through the public API, and the PyTorch
   references) against float64 references, over a grid of shapes, dtypes and layouts
   (contiguous, and strided views such as slices of a packed qkv output).
2. On a GPU, speed in bf16 of the Triton kernel, eager PyTorch and torch.compile of the same
   expression: median ms (CUDA-graph replays, see nanovllm/kernels/benchmark.py), the best of
   three interleaved rounds, GB/s of the bytes that must move, and that as a share of the copy
   bandwidth measured in this run.
3. Peak memory of each path; 4. kernels a call launches (torch.profiler); 5. the
   Qwen3-0.6B-shaped CustomGatedMLP, fused against eager.

On the CPU only correctness runs: the Triton kernels through Triton's interpreter when
TRITON_INTERPRET=1 is set, the references alone otherwise. Results go to DIR (default
./kernel_results): results.json, results.md and profiles.txt. Exits 1 on any mismatch."""
import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

# Functions bound here, before any Triton module is imported (see the report on dispatch).
from nanovllm.kernels import (apply_rotary_emb, backend_for, benchmark_kernel, element_wise_mul_add,
                              fused_add_gelu, fused_add_rms_norm, gelu_and_mul, rms_norm, silu_and_mul,
                              qk_norm_rope_store, store_kvcache)
from nanovllm.kernels import reference
from nanovllm.kernels.benchmark import clone_arguments

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


# ----------------------------------------------------------------------------- correctness
def _upcast(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
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
    return max(_relative_error(g, e) for g, e in zip(got, expected))


def correctness_grid(device: torch.device, quick: bool):
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


def run_correctness(device: torch.device, quick: bool, backends: dict):
    rows_grid, widths, dtypes = correctness_grid(device, quick)
    print(f"correctness: rows {rows_grid}, widths {widths}, dtypes {[str(d)[6:] for d in dtypes]}, "
          f"layouts contiguous/strided, backends {list(backends)}")
    records = []
    for op in OPS:
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


# ----------------------------------------------------------------------------- GPU measurements
def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting the bytes read and written, timed with events
    around eager copies. Not through benchmark_kernel: replayed from a CUDA graph the same copy
    measured 2.6 TB/s on an H200 where eager copies gave 4.25 TB/s (2026-11-21)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return 2 * _nbytes(src) / statistics.median(times) / 1e6


def peak_mib(fn: Callable, args: list) -> float:
    """Peak memory one call allocates beyond what is already there."""
    args, _ = clone_arguments(args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def count_kernels(fn: Callable, args: list) -> tuple[int, str]:
    from torch.profiler import ProfilerActivity, profile
    args, _ = clone_arguments(args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), prof.key_averages().table(sort_by="device_time_total", row_limit=12)


def _compiled(fn: Callable, compile_seconds: list) -> Callable:
    """torch.compile(fn) for fixed shapes; the first call's compile time is added up."""
    compiled = torch.compile(fn, dynamic=False)
    state = {"first": True}

    def call(*args):
        if not state["first"]:
            return compiled(*args)
        started = time.perf_counter()
        out = compiled(*args)
        torch.cuda.synchronize()
        compile_seconds.append(time.perf_counter() - started)
        state["first"] = False
        return out
    return call


def _raise_recompile_limit() -> None:
    """Every timed shape is compiled on its own (dynamic=False, the fastest code inductor makes);
    past the default limit of 8 a function would silently run eager."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)


# Paths are timed in turn, ROUNDS times, and each keeps its best round: the GPU's state drifts
# between runs by up to 50% on 2 us calls (H100), and interleaving gives every path the same.
ROUNDS = 3


def time_paths(case: Case, paths: dict, copy_gbs: float) -> dict:
    iters = 20 if case.bytes_moved > 256 << 20 else 50
    rounds = {name: [] for name in paths}
    for _ in range(ROUNDS):
        for name, fn in paths.items():
            rounds[name].append(benchmark_kernel(fn, *case.args, warmup=5, iters=iters))
    ms = {name: min(times) for name, times in rounds.items()}
    gbs = case.bytes_moved / ms["triton"] / 1e6
    return dict(bytes_moved=case.bytes_moved, ms=ms, rounds_ms=rounds, triton_gbs=gbs, pct_of_copy=100 * gbs / copy_gbs,
                speedup_vs_eager=ms["eager"] / ms["triton"], speedup_vs_compile=ms["compile"] / ms["triton"],
                peak_mib={name: peak_mib(fn, case.args) for name, fn in paths.items()})


def run_speed(copy_gbs: float, quick: bool):
    _raise_recompile_limit()
    rows_grid = (1, 64, 4096, 32768) if quick else (1, 64, 256, 4096, 32768)
    records, profiles, compile_seconds = [], [], []
    for op in OPS:
        for width, strided in op.bench:
            for rows in rows_grid:
                torch.manual_seed(0)
                case = op.make(rows, width, torch.bfloat16, torch.device("cuda"), strided)
                paths = {"triton": op.fused, "eager": op.eager, "compile": _compiled(op.eager, compile_seconds)}
                record = dict(op=op.name, rows=rows, width=width, strided=strided, dtype="bfloat16",
                              **time_paths(case, paths, copy_gbs))
                if rows == 4096:  # kernels a call launches do not depend on the row count
                    record["kernels"] = {}
                    for name, fn in paths.items():
                        record["kernels"][name], table = count_kernels(fn, case.args)
                        profiles.append(f"### {op.name} [{name}] {rows}x{width}{' strided' if strided else ''} "
                                        f"bf16: {record['kernels'][name]} kernel(s)\n{table}")
                records.append(record)
                ms = record["ms"]
                print(f"  {op.name:20s} {rows:5d}x{width:<4d}{'s' if strided else ' '} triton {ms['triton']:.4f} ms"
                      f"  eager {ms['eager']:.4f}  compile {ms['compile']:.4f}  {record['triton_gbs']:6.0f} GB/s"
                      f" ({record['pct_of_copy']:3.0f}% of copy)  x{record['speedup_vs_eager']:.2f} eager"
                      f"  x{record['speedup_vs_compile']:.2f} compile"
                      + (f"  kernels {'/'.join(str(v) for v in record['kernels'].values())}" if "kernels" in record else ""))
    print(f"torch.compile: {len(compile_seconds)} compilations, {sum(compile_seconds):.1f}s in all")
    return records, profiles, sum(compile_seconds)


def run_mlp():
    """Qwen3-0.6B's MLP (hidden 1024, intermediate 3072) in bf16: fused silu_and_mul against
    eager silu(gate) * up, both checked against a float64 run of the same weights."""
    from nanovllm.layers.custom_mlp import CustomGatedMLP
    torch.manual_seed(0)
    fused = CustomGatedMLP(1024, 3072).to(device="cuda", dtype=torch.bfloat16)
    for p in fused.parameters():
        torch.nn.init.normal_(p, std=1024 ** -0.5)
    plain = CustomGatedMLP(1024, 3072, use_custom_kernels=False).to(device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    exact = CustomGatedMLP(1024, 3072, use_custom_kernels=False).to(device="cuda", dtype=torch.float64)
    exact.load_state_dict(fused.state_dict())
    records = []
    with torch.inference_mode():
        for tokens in (1, 64, 4096):
            x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
            ref = exact(x.double())
            record = dict(tokens=tokens, rel_error={n: _relative_error(m(x), ref) for n, m in
                                                    (("fused", fused), ("eager", plain))},
                          ms={n: benchmark_kernel(m, x, iters=50) for n, m in (("fused", fused), ("eager", plain))},
                          peak_mib={n: peak_mib(m, [x]) for n, m in (("fused", fused), ("eager", plain))})
            record["speedup"] = record["ms"]["eager"] / record["ms"]["fused"]
            record["ok"] = record["rel_error"]["fused"] <= TOLERANCE[torch.bfloat16]
            records.append(record)
            print(f"  MLP tokens={tokens:5d} fused {record['ms']['fused']:.4f} ms  eager {record['ms']['eager']:.4f} ms"
                  f"  x{record['speedup']:.2f}  rel error fused {record['rel_error']['fused']:.2e}"
                  f" eager {record['rel_error']['eager']:.2e}  peak MiB {record['peak_mib']}")
    return records


# ----------------------------------------------------------------------------- report
def _markdown(results: dict) -> str:
    lines = [f"# Kernel results\n\n{results['environment']}\n"]
    lines.append("## Correctness (worst relative error against float64)\n")
    lines.append("| op | dtype | backend | cases | worst rel. error | tolerance | status |")
    lines.append("|---|---|---|---|---|---|---|")
    groups = {}
    for r in results["correctness"]:
        groups.setdefault((r["op"], r["dtype"], r["backend"]), []).append(r)
    for (op, dtype, backend), rs in groups.items():
        worst = max(r["rel_error"] for r in rs)
        status = "ok" if all(r["ok"] for r in rs) else "FAIL"
        lines.append(f"| {op} | {dtype} | {backend} | {len(rs)} | {worst:.2e} | {rs[0]['tolerance']:.0e} | {status} |")
    if results.get("speed"):
        lines.append(f"\n## Speed, bf16 (copy bandwidth {results['copy_gbs']:.0f} GB/s)\n")
        lines.append("| op | shape | triton ms | eager ms | compile ms | triton GB/s | % of copy | x eager "
                     "| x compile | peak MiB triton/eager/compile | kernels triton/eager/compile |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["speed"]:
            ms, pk = r["ms"], r["peak_mib"]
            kernels = "/".join(str(v) for v in r["kernels"].values()) if "kernels" in r else ""
            lines.append(f"| {r['op']} | {r['rows']}x{r['width']}{' strided' if r['strided'] else ''} | "
                         f"{ms['triton']:.4f} | {ms['eager']:.4f} | {ms['compile']:.4f} | {r['triton_gbs']:.0f} | "
                         f"{r['pct_of_copy']:.0f}% | {r['speedup_vs_eager']:.2f} | {r['speedup_vs_compile']:.2f} | "
                         f"{pk['triton']:.1f}/{pk['eager']:.1f}/{pk['compile']:.1f} | {kernels} |")
        lines.append("\n## CustomGatedMLP 1024 -> 3072, bf16\n")
        lines.append("| tokens | fused ms | eager ms | speed-up | rel. error fused / eager | peak MiB fused / eager |")
        lines.append("|---|---|---|---|---|---|")
        for r in results["mlp"]:
            lines.append(f"| {r['tokens']} | {r['ms']['fused']:.4f} | {r['ms']['eager']:.4f} | {r['speedup']:.2f} | "
                         f"{r['rel_error']['fused']:.2e} / {r['rel_error']['eager']:.2e} | "
                         f"{r['peak_mib']['fused']:.1f} / {r['peak_mib']['eager']:.1f} |")
    else:
        lines.append("\nSpeed, memory and kernel counts need a CUDA GPU: not measured in this run.")
    return "\n".join(lines) + "\n"


def _environment(device: torch.device, backends: dict) -> str:
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return (f"device {name}{interp}; torch {torch.__version__}; triton {triton_version}; "
            f"backends checked: {', '.join(backends)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kernel_results", help="folder for results.json, results.md, profiles.txt")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = {"torch": lambda op: op.ref}
    if backend_for(device) == "triton":
        backends["triton"] = lambda op: op.fused
    else:
        print(f"Triton backend: not run on {device} (needs a CUDA GPU or TRITON_INTERPRET=1); "
              "checking the PyTorch references only")
    environment = _environment(device, backends)
    print(environment)
    correctness, failures = run_correctness(device, args.quick, backends)
    results = dict(environment=environment, correctness=correctness, failures=failures)
    profiles = []
    if device.type == "cuda":
        results["copy_gbs"] = copy_bandwidth_gbs()
        print(f"device copy bandwidth: {results['copy_gbs']:.0f} GB/s (read + write)")
        results["speed"], profiles, results["compile_seconds"] = run_speed(results["copy_gbs"], args.quick)
        results["mlp"] = run_mlp()
        failures += sum(not r["ok"] for r in results["mlp"])
    else:
        print("speed, memory and kernel counts need a CUDA GPU: skipped")
    results["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(_markdown(results))
    if profiles:
        (out / "profiles.txt").write_text("\n\n".join(profiles))
    print(f"{'FAILED' if failures else 'all correct'}: {failures} mismatch(es); {results['seconds']:.0f}s; "
          f"results in {out}/")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
