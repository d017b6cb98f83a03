"""Triton kernel for linear layers of a few rows: y = x W^T (+ b), x [M <= 16, K], W [N, K],
the projections and LM head of decode batches. At such sizes a matmul is a read of W: a few
MB a projection, which cuBLAS's small-M kernels take several times its read time for
(docs/performance.md#small-batch-gemv).

Programs own BLOCK_N output features and a run of K ("split-K", as many runs as _splits
finds best), so that even one row keeps every SM busy; each multiplies its weight tiles
with x^T on the tensor cores (the M side padded to 16, the smallest tl.dot takes; the
padding is free next to the weight traffic). With one split a program stores its outputs; with several, each
stores an fp32 partial and counts itself in at its feature tile's counter, and the last to
arrive adds the partials in split order (the sum does not depend on which program finishes
last), adds the bias, stores the output and sets the counter back to 0 for the next call:
one launch, no memset. The split count is a compile-time constant, so that reduction is
unrolled and issues every partial's load before the first add: one L2 round trip instead of
one a split. The counters are one buffer per device, so two of these kernels must
not run at once on two streams of a device.

One or two rows of x (decode of one or two sequences) go to a second kernel where a few rows
of W fit a program's registers: each program owns a handful of output features and all of K,
loads them before its wait, and sums the products on the CUDA cores. Nothing is split, so
there are no partials and no counter to wait on after the input arrives: decode steps of one
and two sequences are shorter than on the split-K kernel. At four rows the products outweigh
what the split saved (both measured: docs/rejected.md). The kernel can also compute its
input: the decoder's RMSNorm (with the residual add) before qkv and gate_up, and the gated
activation before down (norm_linear, act_linear), so those kernels disappear from small
decode steps.

No kernel of the package writes weights, so each program reads its first weight tile before
it waits for the kernel before it (programmatic dependent launch, launch.py): the read
overlaps that kernel's end. Given the weight of the projection a decode step runs next, the
split-K kernel's programs also split its bytes among them and issue L2 prefetches for their
share at that point, so the next GEMV reads its weight from L2 instead of HBM
(NANOVLLM_GEMV_PREFETCH=0 turns this off)."""
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.activation import activate
from nanovllm.kernels.interpreter import INTERPRETER
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch, occupancy_cap
from nanovllm.kernels.tiling import cdiv, next_power_of_2

MAX_ROWS = 16  # rows of x a call serves: one tl.dot tile
# Two resident programs an SM: 3 pipeline stages of 16 KB weight tiles take 80 KB of shared
# memory a pipelined program (sm_90 build), and a wave of them holds more bytes in flight than
# HBM needs.
PROGRAMS_PER_SM = 2
_BLOCK_N = 64  # the M side of a Hopper wgmma
_TILE_BYTES = 16 << 10  # weight bytes a program reads per step
_MAX_TILES_SPLIT = 4096  # counters per device: feature tiles a split call may have
# Weight tiles a program reads up to which it runs unpipelined: its pipeline's shared memory
# (3 stages of 16 KB) bought nothing there, and without it decode steps were shorter
# (docs/rejected.md).
_UNPIPELINED_TILES = 4
_MAX_SPLITS = 32  # partials the last program's unrolled reduction adds
_LINE = 128  # bytes an L2 prefetch fetches
_MAX_PREFETCH_LINES = 2048  # a program's share of the next weight above which none is prefetched (256 KB)
# Next weights above this are not prefetched: beside the running GEMV's own stream, more than a
# third of a Hopper L2 (50 MB) would be evicted before its use and read twice.
_MAX_PREFETCH_BYTES = 16 << 20
prefetch_enabled = os.environ.get("NANOVLLM_GEMV_PREFETCH", "1") != "0"
ROW_MAX_ROWS = 2  # rows of x the row kernel serves (kernels.GEMV_ROW_MAX_ROWS)
_ROW_PROGRAM_BYTES = 16 << 10  # weight a row-kernel program holds in registers
_ROW_WARPS = 4
# norm_linear(leave_room=True): at most this many programs an SM, where the grid fits so. At 64
# registers a thread eight would fit, and qkv's programs, starting as the kernel before leaves,
# filled the SMs that freed first and left the decode attention after them no room to start
# and read its first key tile before its wait. Capping every row grid that fits, o's and
# down's too, gained no more (docs/rejected.md).
_ROW_PROGRAMS_PER_SM_CAP = 4
# Input bytes that a fused prologue's programs may read between them (each reads the whole
# input row): about what L2 serves while the separate kernel's boundary lasts. Qwen3-0.6B's
# norms and activation re-read 2-6 MB and fused gain; Qwen3-8B's norms would re-read 48-192
# MB, and fused lose (docs/rejected.md).
_MAX_PROLOGUE_BYTES = 8 << 20
_ACTIVATIONS = {"silu": "silu", "gelu": "none", "gelu_tanh": "tanh"}  # act_linear's names -> activate's
row_kernel_enabled = os.environ.get("NANOVLLM_GEMV_ROW", "1") != "0"
_INTERPRETER_SMS = 4  # no SMs under TRITON_INTERPRET: enough programs to split small test shapes
_arrivals: dict[int, torch.Tensor] = {}


class Config(NamedTuple):
    block_n: int
    block_k: int
    splits: int
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int


@triton.jit
def _input_tile(x_ptr, tokens, cols, M, K, x_row_stride, UPCAST: tl.constexpr):
    """x^T [BLOCK_K, BLOCK_M]: rows past M are zeros."""
    mask = (cols < K)[:, None] & (tokens < M)[None, :]
    xt = tl.load(x_ptr + tokens[None, :] * x_row_stride + cols[:, None], mask=mask, other=0.0)
    return xt.to(tl.float32) if UPCAST else xt


@triton.jit
def prefetch_l2(ptrs):
    """Fetches the 128-byte lines holding ptrs into L2; nothing waits for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, features, tokens, N, mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + features, mask=features < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tokens[None, :] * N + features[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, arrivals_ptr, next_ptr, next_lines, M, N, K,
                 x_row_stride, w_row_stride, k_per_split,
                 HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """The output as [BLOCK_N features, BLOCK_M tokens] = W tile @ x^T tile: the weight is the
    wide operand. Masks compare with K, not the split's end: splits start at multiples of
    BLOCK_K, and a K divisible by 16 keeps the loads vectorised."""
    tile, split = tl.program_id(0), tl.program_id(1)
    features = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    feature_mask = (features < N)[:, None]
    w_rows = w_ptr + features.to(tl.int64)[:, None] * w_row_stride
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, K)
    cols = start + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + cols[None, :], mask=feature_mask & (cols < K)[None, :], other=0.0)
    if PREFETCH > 0:  # this program's run of the next weight's lines (PREFETCH: the run's length, padded)
        share = tl.cdiv(next_lines, tl.num_programs(0) * SPLITS)
        offsets = tl.arange(0, PREFETCH)
        lines = tl.minimum((tile * SPLITS + split) * share + tl.where(offsets < share, offsets, 0), next_lines - 1)
        prefetch_l2(next_ptr + lines.to(tl.int64) * LINE)
    await_previous_kernel(PDL)
    # The interpreter has no bf16 arithmetic (its dot of bf16 operands is garbage): it upcasts.
    w = w.to(tl.float32) if UPCAST else w
    acc = tl.dot(w, _input_tile(x_ptr, tokens, cols, M, K, x_row_stride, UPCAST), input_precision=DOT_PRECISION)
    for k in range(start + BLOCK_K, end, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :], mask=feature_mask & (cols < K)[None, :], other=0.0)
        w = w.to(tl.float32) if UPCAST else w
        acc = tl.dot(w, _input_tile(x_ptr, tokens, cols, M, K, x_row_stride, UPCAST), acc,
                     input_precision=DOT_PRECISION)
    mask = feature_mask & (tokens < M)[None, :]
    if SPLITS > 1:
        offsets = tokens[None, :] * N + features[:, None]  # partials are [splits, M, N]
        tl.store(partials_ptr + split * M * N + offsets, acc, mask=mask)
        # Every thread's partial is written before one thread's release-add announces it.
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            # .cg: from L2, where the other programs' partials are, never a stale L1 line
            acc = tl.load(partials_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            for other in tl.static_range(1, SPLITS):
                acc += tl.load(partials_ptr + other * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(arrivals_ptr + tile, 0)
            _store_output(acc, bias_ptr, out_ptr, features, tokens, N, mask, HAS_BIAS)
    else:
        _store_output(acc, bias_ptr, out_ptr, features, tokens, N, mask, HAS_BIAS)


@triton.jit
def _row_input(x_ptr, cols, K, res_ptr, res_out_ptr, norm_weight, eps, embed_scale, row_ok, first_program,
               PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, SCALED: tl.constexpr):
    """(row, scale): one input row of the GEMV in fp32 (zeros where not row_ok) and the factor
    its products take. PROLOGUE "norm": rms_norm(x); "add_norm": rms_norm(x + res), the sum
    stored to res_out by the first program; "embed_norm": rms_norm(x) for x an embedding row
    (times embed_scale where SCALED), which the first program stores to res_out; "act":
    activation(x[:K]) * x[K:2K]. A norm returns x * weight and its 1 / rms as the scale: the sum
    of squares and the products' sums are then independent reductions rather than one after
    the other. The sum and the activation are rounded to x's dtype, as the unfused kernels
    store them; the normalised row is not rounded."""
    mask = (cols < K) & row_ok
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == "embed_norm":
        if SCALED:
            x = (x * embed_scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(res_out_ptr + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask & first_program)
    if PROLOGUE == "act":
        up = tl.load(x_ptr + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = (activate(x, ACTIVATION) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    if PROLOGUE == "add_norm":
        summed = (x + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_out_ptr + cols, summed, mask=mask & first_program)
        x = summed.to(tl.float32)
    scale = 1.0
    if PROLOGUE == "norm" or PROLOGUE == "add_norm" or PROLOGUE == "embed_norm":
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        x = x * norm_weight
    return x, scale


@triton.jit
def _weight_rows(w_ptr, rows, N, K, cols, w_row_stride):
    """Rows `rows` of the [N, K] weight (zeros past N and K), as stored."""
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * w_row_stride + cols[None, :],
                   mask=(rows < N)[:, None] & (cols < K)[None, :], other=0.0)


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _gemv_row_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_row_stride, w_row_stride,
                     res_ptr, res_out_ptr, norm_ptr, eps, ids_ptr, embed_scale,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr,
                     PDL: tl.constexpr):
    """M <= ROWS rows of x (ROWS a power of two): a program owns BLOCK_N rows of the weight and
    all of K, in one BLOCK_K tile loaded before the wait. Products on the CUDA cores and sums
    along K inside the program: no partials, no arrival counter, nothing after the wait but
    the input rows (with their prologue, _row_input), the products and the stores. res and
    res_out rows are K apart. With the "embed_norm" prologue, row m of the input is row
    ids[m] of x (an embedding table), read after the wait: the kernel before writes the ids.
    GATED: the weight is a gated MLP's gate [N, K] above its up [N, K], and out [M, N] is
    activation(gate) * up, a program's rows the gate and up rows of BLOCK_N / 2 features: the
    activation runs once per feature rather than in every program of the down projection
    after it (as the "act" prologue does).
    No L2 prefetch of the next weight: the next kernel's programs
    read theirs before their own wait, and the prefetch only added traffic (docs/rejected.md)."""
    tile = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    if GATED:
        features = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        w = _weight_rows(w_ptr, features, N, K, cols, w_row_stride)
        w_up = _weight_rows(w_ptr + N.to(tl.int64) * w_row_stride, features, N, K, cols, w_row_stride)
    else:
        features = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w = _weight_rows(w_ptr, features, N, K, cols, w_row_stride)
    norm_weight = 1.0
    if PROLOGUE == "norm" or PROLOGUE == "add_norm" or PROLOGUE == "embed_norm":
        norm_weight = tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    bias = 0.0
    bias_up = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + features, mask=features < N, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + N + features, mask=features < N, other=0.0).to(tl.float32)
    await_previous_kernel(PDL)
    w = w.to(tl.float32)
    if GATED:
        w_up = w_up.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        row = m
        if PROLOGUE == "embed_norm":
            row = tl.load(ids_ptr + m, mask=m < M, other=0)
        x, scale = _row_input(x_ptr + row * x_row_stride, cols, K, res_ptr + m * K, res_out_ptr + m * K,
                              norm_weight, eps, embed_scale, m < M, tile == 0, PROLOGUE, ACTIVATION, SCALED)
        acc = tl.sum(w * x[None, :], axis=1) * scale + bias
        if GATED:
            up = tl.sum(w_up * x[None, :], axis=1) * scale + bias_up
            # gate and up rounded as the projection stores them, then as the activation kernel computes
            acc = activate(acc.to(dtype).to(tl.float32), ACTIVATION) * up.to(dtype).to(tl.float32)
        tl.store(out_ptr + m * N + features, acc.to(dtype), mask=(features < N) & (m < M))


@functools.cache
def _sm_count(device_index: int) -> int:
    if device_index < 0:
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def config_for(n: int, k: int, element_size: int, device_index: int, block_n: int = _BLOCK_N,
               block_k: int | None = None, programs_per_sm: int = PROGRAMS_PER_SM,
               num_stages: int | None = None) -> Config:
    """Tiles of _TILE_BYTES of weight; K split as _splits says. Programs of at most
    _UNPIPELINED_TILES weight tiles run without a software pipeline (num_stages 1), longer ones
    with 3 stages. The keywords are for benchmarks/bench_gemv.py's sweep."""
    block_k = block_k or max(16, _TILE_BYTES // (block_n * element_size))
    tiles, k_blocks = cdiv(n, block_n), max(1, cdiv(k, block_k))
    splits = _splits(tiles, k_blocks, programs_per_sm * _sm_count(device_index)) if tiles <= _MAX_TILES_SPLIT else 1
    blocks_per_split = cdiv(k_blocks, splits)
    # A program holds its first tile in registers: more warps for larger tiles.
    num_warps = min(8, max(4, block_n * block_k * element_size // 4096))
    if num_stages is None:
        num_stages = 1 if blocks_per_split <= _UNPIPELINED_TILES else 3
    return Config(block_n, block_k, cdiv(k_blocks, blocks_per_split), blocks_per_split * block_k, num_warps,
                  num_stages)


def _splits(tiles: int, k_blocks: int, slots: int) -> int:
    """The fewest runs of K that minimise waves x (K blocks + 1) per program: the time of the
    busiest SM when `slots` programs run at once and each takes as long as its blocks plus
    one block's worth of fixed cost (start, epilogue, partials; an estimate). Qwen3-0.6B's
    qkv at one row: 64 tiles of 8 blocks in 4 runs, one wave of 256 programs; Qwen3-8B's
    gate_up: 384 tiles of 32 blocks in 2 runs, 3 waves, against 2 waves of 32 unsplit."""
    return min(range(1, min(k_blocks, _MAX_SPLITS) + 1),
               key=lambda s: (cdiv(tiles * s, slots) * (cdiv(k_blocks, s) + 1), s))


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """Zeros that every split call leaves as it found them. Allocated once per device and
    never replaced: captured graphs keep its address."""
    index = device.index if device.type == "cuda" else -1
    counters = _arrivals.get(index)
    if counters is None:
        counters = _arrivals[index] = torch.zeros(_MAX_TILES_SPLIT, dtype=torch.int32, device=device)
    return counters


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           config: Config, prefetch: torch.Tensor | None = None) -> None:
    """out [M, N] (contiguous) = x [M, K] @ weight [N, K]^T (+ bias), both with unit stride along K.
    `prefetch`: a contiguous tensor to read into L2 on the way (the next projection's weight)."""
    m, k = x.shape
    n = weight.shape[0]
    split = config.splits > 1
    partials = torch.empty((config.splits, m, n), dtype=torch.float32, device=x.device) if split else out
    arrivals = _arrival_counters(x.device) if split else out
    upcast = INTERPRETER and x.dtype == torch.bfloat16
    tiles = cdiv(n, config.block_n)
    lines, run = _prefetch_run(prefetch, tiles * config.splits)
    _gemv_kernel[(tiles, config.splits)](
        x, weight, out if bias is None else bias, out, partials, arrivals,
        prefetch.view(-1).view(torch.uint8) if run else out, lines, m, n, k, x.stride(0), weight.stride(0),
        config.k_per_split,
        HAS_BIAS=bias is not None, SPLITS=config.splits, BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PREFETCH=run, LINE=_LINE, UPCAST=upcast, DOT_PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **dependent_launch(x.get_device()))


@functools.cache
def row_config(n: int, k: int, element_size: int, device_index: int) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) of _gemv_row_kernel, or None where a program's features would not
    fit _ROW_PROGRAM_BYTES of weight: the most features a program that still leaves
    PROGRAMS_PER_SM programs to every SM."""
    block_k = next_power_of_2(k)
    if block_k * element_size > _ROW_PROGRAM_BYTES:
        return None
    block_n = max(1, min(64, _ROW_PROGRAM_BYTES // (block_k * element_size)))
    while block_n > 1 and cdiv(n, block_n) < PROGRAMS_PER_SM * _sm_count(device_index):
        block_n //= 2
    return block_n, block_k


def _launch_row(x, weight, bias, out, block_n: int, block_k: int, prologue: str = "none", residual=None,
                residual_out=None, norm_weight=None, eps: float = 0.0, activation: str = "silu",
                leave_room: bool = False, ids=None, embed_scale: float | None = None, gated: bool = False) -> None:
    """x: ROW_MAX_ROWS rows at most, with unit stride ([M, 2K] for the "act" prologue, else
    [M, K]), or for "embed_norm" the embedding table whose rows `ids` (M int64) names;
    residual and residual_out contiguous [M, K]. `gated`: out is [M, N / 2], the activation
    of the weight's first N / 2 rows' outputs times the last N / 2's (block_n even)."""
    n, k = weight.shape
    if gated:
        n //= 2
    programs, device = cdiv(n, block_n // 2 if gated else block_n), x.get_device()
    rows = x.shape[0] if ids is None else ids.numel()
    capped = leave_room and programs <= _ROW_PROGRAMS_PER_SM_CAP * _sm_count(device)
    cap = occupancy_cap(device, _ROW_PROGRAMS_PER_SM_CAP) if capped else {}
    _gemv_row_kernel[(programs,)](
        x, weight, out if bias is None else bias, out, rows, n, k, x.stride(0), weight.stride(0),
        x if residual is None else residual, x if residual_out is None else residual_out,
        out if norm_weight is None else norm_weight, eps, out if ids is None else ids,
        1.0 if embed_scale is None else embed_scale,
        HAS_BIAS=bias is not None, ROWS=next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        PROLOGUE=prologue, ACTIVATION=activation, SCALED=embed_scale is not None, GATED=gated, num_warps=_ROW_WARPS,
        num_stages=1, **dependent_launch(device), **cap)


def _row_block(x: torch.Tensor, n: int, k: int) -> tuple[int, int] | None:
    """The row kernel's blocks for x's rows, or None where it does not serve: turned off, more
    than ROW_MAX_ROWS rows, a weight row over a program's budget."""
    if not row_kernel_enabled or x.shape[-1] == 0 or x.numel() > ROW_MAX_ROWS * x.shape[-1]:
        return None
    return row_config(n, k, x.element_size(), x.get_device())


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x ([..., width]) as [M, width] rows with unit stride."""
    rows = x if x.dim() == 2 else x.reshape(-1, width)  # 2-D as it is: -1 is ambiguous for width 0
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _prologue_block(x, n: int, k: int, input_bytes: int) -> tuple[int, int] | None:
    """_row_block for a fused prologue that reads `input_bytes` a row in every program, or
    None also where its programs would re-read more than _MAX_PROLOGUE_BYTES between them."""
    if x.numel() == 0 or n == 0:
        return None
    block = _row_block(x, n, k)
    if block is None or cdiv(n, block[0]) * input_bytes * (x.numel() // x.shape[-1]) > _MAX_PROLOGUE_BYTES:
        return None
    return block


def _gated_block(block: tuple[int, int] | None, element_size: int) -> tuple[int, int] | None:
    """The row block for a gated epilogue: a program holds a feature's gate and up rows, two
    at least, even where that makes fewer programs than PROGRAMS_PER_SM an SM; None where two
    weight rows exceed a program's budget."""
    if block is None or 2 * block[1] * element_size > _ROW_PROGRAM_BYTES:
        return None
    return max(2, block[0]), block[1]


def _unit_stride(weight: torch.Tensor, bias: torch.Tensor | None):
    """The weight with unit stride along K and a unit-stride bias, copied where they are not:
    a transposed weight costs a copy of it every call."""
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return weight, bias if bias is None or bias.stride(0) == 1 else bias.contiguous()


def norm_linear(x, residual, norm_weight, eps, weight, bias=None, prefetch=None, leave_room=False, activation=None):
    """kernels.norm_linear in one launch of the row kernel, or None where it does not serve
    (_prologue_block, and for `activation` _gated_block). `prefetch` is unused:
    the row kernel does not prefetch. `leave_room`: at most _ROW_PROGRAMS_PER_SM_CAP programs
    an SM."""
    n, k = weight.shape
    block = _prologue_block(x, n, k, (1 if residual is None else 2) * k * x.element_size())
    if activation is not None:
        block = _gated_block(block, x.element_size())
    if block is None:
        return None
    out = torch.empty((*x.shape[:-1], n if activation is None else n // 2), dtype=x.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    weight, bias = _unit_stride(weight, bias)
    _launch_row(_rows(x, k), weight, bias, out, *block, "norm" if residual is None else "add_norm",
                None if residual is None else residual.reshape(-1, k).contiguous(), residual_out,
                norm_weight.contiguous(), eps, leave_room=leave_room,
                activation=_ACTIVATIONS[activation or "silu"], gated=activation is not None)
    return out, residual_out


def linear_act(x, weight, bias=None, prefetch=None, activation="silu"):
    """kernels.linear_act in one launch of the row kernel, or None where it does not serve
    (_row_block, _gated_block); `prefetch` unused, as in norm_linear."""
    n, k = weight.shape
    block = _gated_block(_row_block(x, n, k), x.element_size())
    if block is None or x.numel() == 0:
        return None
    out = torch.empty((*x.shape[:-1], n // 2), dtype=x.dtype, device=x.device)
    weight, bias = _unit_stride(weight, bias)
    _launch_row(_rows(x, k), weight, bias, out, *block, activation=_ACTIVATIONS[activation], gated=True)
    return out


def embed_norm_linear(input_ids, embed_weight, embed_scale, norm_weight, eps, weight, bias=None, leave_room=False):
    """kernels.embed_norm_linear in one launch of the row kernel, or None where it does not
    serve (_prologue_block); `leave_room` as in norm_linear."""
    n, k = weight.shape
    embedded = torch.empty((input_ids.numel(), k), dtype=embed_weight.dtype, device=embed_weight.device)
    block = _prologue_block(embedded, n, k, k * embedded.element_size())
    if block is None or embed_weight.stride(1) != 1:
        return None
    out = torch.empty((input_ids.numel(), n), dtype=embed_weight.dtype, device=embed_weight.device)
    weight, bias = _unit_stride(weight, bias)
    _launch_row(embed_weight, weight, bias, out, *block, "embed_norm", residual_out=embedded,
                norm_weight=norm_weight.contiguous(), eps=eps, leave_room=leave_room, ids=input_ids.contiguous(),
                embed_scale=embed_scale)
    return out, embedded


def act_linear(x, weight, bias=None, prefetch=None, activation="silu"):
    """kernels.act_linear in one launch of the row kernel, or None where it does not serve;
    `prefetch` unused, as in norm_linear."""
    n, k = weight.shape
    block = _prologue_block(x, n, k, 2 * k * x.element_size())
    if block is None:
        return None
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    weight, bias = _unit_stride(weight, bias)
    _launch_row(_rows(x, 2 * k), weight, bias, out, *block, "act", activation=_ACTIVATIONS[activation])
    return out


def _prefetch_run(prefetch: torch.Tensor | None, programs: int) -> tuple[int, int]:
    """-> (lines of `prefetch`, a program's share of them padded to a power of two), (0, 0)
    for no prefetch: none asked, turned off, the interpreter (no inline PTX), a tensor larger
    than _MAX_PREFETCH_BYTES, or a share too large to issue before the kernel's own work."""
    nbytes = 0 if prefetch is None else prefetch.numel() * prefetch.element_size()
    if not (prefetch_enabled and 0 < nbytes <= _MAX_PREFETCH_BYTES) or INTERPRETER:
        return 0, 0
    lines = cdiv(nbytes, _LINE)
    share = cdiv(lines, programs)
    return (lines, next_power_of_2(share)) if share <= _MAX_PREFETCH_LINES else (0, 0)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """Returns a new contiguous [..., N] tensor. Operands without unit stride along K (and a
    strided bias) are copied first (_unit_stride)."""
    k, n = x.shape[-1], weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = _rows(x, k)
    weight, bias = _unit_stride(weight, bias)
    block = _row_block(rows, n, k)
    if block is not None:
        _launch_row(rows, weight, bias, out, *block)
    else:
        launch(rows, weight, bias, out, config_for(n, k, x.element_size(), x.get_device()), prefetch)
    return out
