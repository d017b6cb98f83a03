"""Triton kernels of a mixture-of-experts layer: top-k routing, the token-to-expert alignment and
a grouped GEMM over the experts, with the activation or the routing weight in its epilogue.

A layer runs five launches whatever its batch: moe_topk (softmax, top-k, renormalisation, a
program per block of tokens), _align (sorts the (token, k) slots by expert and pads each
expert's run to the GEMM's BLOCK_M rows), the gate_up GEMM (act(gate) * up stored per slot),
the down GEMM (times the slot's routing weight) and _sum_topk (a token's k rows added in
order). The GEMMs' grids cover the worst-case number of row blocks, known from the shapes
alone; a block past the experts that got tokens reads expert -1 and returns. Nothing reads a
tensor's values on the host: a decode step replays in a CUDA graph, and a step of one token
runs the k experts it picked, not a loop over all of them.

Why a per-token sum and not atomic adds into the output: the k rows of a token are added in
one fixed order in fp32 and rounded once, so a token's output does not depend on the batch or
on which expert's program finished first, and no fp32 buffer needs zeroing and a cast pass."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.activation import activate
from nanovllm.kernels.interpreter import INTERPRETER
from nanovllm.kernels.reference import max_row_blocks
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch
from nanovllm.kernels.tiling import cdiv, next_power_of_2

# (largest token count, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the two GEMMs; the
# first row whose bound holds. Decode batches give each expert a few rows: a 16-row tile wastes
# least of the weight read, which bounds those steps; prefill tiles grow to reuse each weight
# tile across more rows once the experts' runs are long enough to fill them.
GEMM_CONFIGS = (
    (256, 16, 64, 128, 4, 4),
    (1024, 64, 64, 64, 4, 4),
    (2048, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
)
# fused_moe's activation names (act_linear's) -> activate's
_ACTIVATIONS = {"silu": "silu", "gelu": "none", "gelu_tanh": "tanh"}
_ALIGN_CHUNK = 1024  # (token, k) slots a program of _align sorts
_TOPK_TOKENS = 16  # tokens a program of moe_topk routes


def gemm_config(num_tokens: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a layer of num_tokens tokens;
    fp32 operands take half the K tile (twice the bytes in shared memory)."""
    block_m, block_n, block_k, warps, stages = next(row[1:] for row in GEMM_CONFIGS
                                                    if row[0] is None or num_tokens <= row[0])
    if dtype == torch.float32:
        block_k //= 2
    return block_m, block_n, block_k, warps, stages


@fast_launch
@triton.jit(do_not_specialize=["n_tokens"])
def _topk_kernel(logits_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, logits_stride,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_ok = tokens < n_tokens
    mask = token_ok[:, None] & (experts < n_experts)[None, :]
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * logits_stride + experts[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)
    logits = tl.where(token_ok[:, None], logits, 0.0)  # rows past the batch: no -inf - -inf
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]
    probs = tl.where(mask, probs, -1.0)  # below every probability: padding is never picked
    columns = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        # tie_break_left: of equal probabilities the lowest expert id ranks first
        best = tl.argmax(probs, axis=1, tie_break_left=True)
        value = tl.max(probs, axis=1)
        picked = tl.where(columns[None, :] == j, value[:, None], picked)
        picked_ids = tl.where(columns[None, :] == j, best[:, None], picked_ids)
        probs = tl.where(experts[None, :] == best[:, None], -2.0, probs)
    if RENORMALIZE:
        picked = picked / tl.sum(picked, axis=1)[:, None]
    offsets = tokens.to(tl.int64)[:, None] * TOP_K + columns[None, :]
    out_mask = token_ok[:, None] & (columns < TOP_K)[None, :]
    tl.store(weights_ptr + offsets, picked, mask=out_mask)
    tl.store(ids_ptr + offsets, picked_ids, mask=out_mask)


@fast_launch
@triton.jit(do_not_specialize=["n_slots", "max_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, n_slots, n_experts, max_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                  PDL: tl.constexpr):
    """Program p places the slots of chunk p at their rows: its expert's start, plus the slots
    of that expert in earlier chunks, plus its rank among its expert's slots in the chunk (a
    sort by (expert, slot)), so every expert's run keeps slot order. Each program histograms
    every chunk itself (a few KB), which spares a launch and a global counter. Program 0 also
    fills each expert's padding rows with n_slots and writes each block's expert."""
    await_previous_kernel(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    mine = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(0, tl.cdiv(n_slots, CHUNK)):
        slots = chunk * CHUNK + lanes
        counts = tl.histogram(tl.load(ids_ptr + slots, mask=slots < n_slots, other=0), BLOCK_E, mask=slots < n_slots)
        total += counts
        before += tl.where(chunk < pid, counts, 0)
        mine += tl.where(chunk == pid, counts, 0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    slots = pid * CHUNK + lanes
    ids = tl.load(ids_ptr + slots, mask=slots < n_slots, other=0)
    keys = tl.sort(tl.where(slots < n_slots, ids * CHUNK + lanes, BLOCK_E * CHUNK))
    valid = keys < BLOCK_E * CHUNK
    expert = tl.where(valid, keys // CHUNK, 0)
    # row of the chunk's j-th slot in sorted order: its expert's base plus j
    base = starts + before - (tl.cumsum(mine, axis=0) - mine)
    rows = tl.gather(base, expert, 0) + lanes
    tl.store(sorted_ptr + rows, pid * CHUNK + keys % CHUNK, mask=valid)
    if pid == 0:
        pad = tl.arange(0, BLOCK_M)
        pad_rows = (starts + total)[:, None] + pad[None, :]
        tl.store(sorted_ptr + pad_rows, tl.full([BLOCK_E, BLOCK_M], 0, tl.int32) + n_slots,
                 mask=pad[None, :] < (padded - total)[:, None])
        # block b belongs to the expert whose run holds it: the number of runs ending at or before b
        ends = (starts + padded) // BLOCK_M
        for first in range(0, max_blocks, BLOCK_B):
            blocks = first + tl.arange(0, BLOCK_B)
            owner = tl.sum(((ends[None, :] <= blocks[:, None]) & (experts < n_experts)[None, :]).to(tl.int32),
                           axis=1)
            tl.store(block_experts_ptr + blocks, tl.where(owner < n_experts, owner, -1), mask=blocks < max_blocks)


@fast_launch
@triton.jit(do_not_specialize=["n_slots"])
def _gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_experts_ptr, route_weights_ptr,
                 n_slots, N, K, a_stride, w_stride_e, w_stride_n, out_stride,
                 ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, WEIGHTED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, PDL: tl.constexpr):
    """out[slot, n] for the slots of one row block and BLOCK_N features, through the block's
    expert's weight w[e] ([N, K], or [2N, K] gate above up when GATED: act(gate) * up). Row
    `slot` of the output reads row slot // ROWS_PER_A of a (the token of the slot, for gate_up;
    the slot itself, for down). WEIGHTED: times route_weights[slot]."""
    await_previous_kernel(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    block = pid // n_tiles
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    slot_ok = slots < n_slots
    features = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // ROWS_PER_A).to(tl.int64)[:, None] * a_stride + k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * w_stride_e + features.to(tl.int64)[None, :] * w_stride_n + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = k < K - k_start
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & feature_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter has no bf16 arithmetic (its dot of bf16 operands is garbage)
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(w_ptrs + N * w_stride_n, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = activate(acc, ACTIVATION) * acc_up
    if WEIGHTED:
        acc *= tl.load(route_weights_ptr + slots, mask=slot_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * out_stride + features[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & feature_ok[None, :])


@fast_launch
@triton.jit(do_not_specialize=["n_tokens"])
def _sum_topk_kernel(rows_ptr, out_ptr, n_tokens, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + j) * H + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    n_tokens, n_experts = router_logits.shape
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(n_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if n_tokens == 0:
        return weights, ids
    block_e = next_power_of_2(n_experts)
    block_t = max(1, min(_TOPK_TOKENS, 8192 // block_e))
    _topk_kernel[(cdiv(n_tokens, block_t),)](
        router_logits, weights, ids, n_tokens, n_experts, router_logits.stride(0), TOP_K=top_k,
        RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k),
        num_warps=4, **dependent_launch(router_logits.get_device()))
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    slots = topk_ids.numel()
    blocks = max_row_blocks(slots, num_experts, block_m)
    sorted_slots = torch.empty(max(blocks, 1) * block_m, dtype=torch.int32, device=topk_ids.device)
    block_experts = torch.empty(max(blocks, 1), dtype=torch.int32, device=topk_ids.device)
    if slots == 0:
        block_experts.fill_(-1)
        return sorted_slots, block_experts
    _align_kernel[(cdiv(slots, _ALIGN_CHUNK),)](
        topk_ids.reshape(-1), sorted_slots, block_experts, slots, num_experts, blocks, BLOCK_M=block_m,
        CHUNK=min(_ALIGN_CHUNK, next_power_of_2(slots)), BLOCK_E=next_power_of_2(num_experts), BLOCK_B=64,
        num_warps=4, **dependent_launch(topk_ids.get_device()))
    return sorted_slots, block_experts


def _grouped_gemm(a, w, out, sorted_slots, block_experts, route_weights, n_slots, n_out, config, rows_per_a,
                  activation=None):
    block_m, block_n, block_k, warps, stages = config
    upcast = INTERPRETER and a.dtype == torch.bfloat16
    grid = (block_experts.shape[0] * cdiv(n_out, block_n),)
    _gemm_kernel[grid](
        a, w, out, sorted_slots, block_experts, route_weights, n_slots, n_out, w.shape[2], a.stride(0), w.stride(0),
        w.stride(1), out.stride(0), ROWS_PER_A=rows_per_a, GATED=activation is not None,
        ACTIVATION=_ACTIVATIONS[activation or "silu"], WEIGHTED=route_weights is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION="ieee" if a.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, num_warps=warps, num_stages=stages, **dependent_launch(a.get_device()))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    n_tokens, hidden = x.shape
    top_k, intermediate = topk_ids.shape[1], w2.shape[2]
    out = torch.empty(n_tokens, hidden, dtype=x.dtype, device=x.device)
    if n_tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w2 = (w if w.stride(2) == 1 else w.contiguous() for w in (w13, w2))
    n_slots = n_tokens * top_k
    config = gemm_config(n_tokens, x.dtype)
    sorted_slots, block_experts = moe_align(topk_ids, w13.shape[0], config[0])
    activated = torch.empty(n_slots, intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, activated, sorted_slots, block_experts, None, n_slots, intermediate, config, top_k,
                  activation)
    weighted = torch.empty(n_slots, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(activated, w2, weighted, sorted_slots, block_experts, topk_weights.reshape(-1), n_slots, hidden,
                  config, 1)
    block_h = min(1024, next_power_of_2(hidden))
    _sum_topk_kernel[(n_tokens, cdiv(hidden, block_h))](weighted, out, n_tokens, hidden, TOP_K=top_k, BLOCK_H=block_h,
                                                        num_warps=4, **dependent_launch(x.get_device()))
    return out
