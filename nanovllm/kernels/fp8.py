"""FP8 (e4m3) weight matmuls: y = x W^T + b with W stored in float8_e4m3fn and dequantized by
fp32 multipliers, one per output row (scale [N, 1]) or one per block[0] x block[1] tile
(Hugging Face's `weight_scale_inv`). Activations are quantized per token (row) on the fly:
x ~= x_q * s_x with s_x = max|x_row| / 448; products accumulate in fp32.

Routing: row scales with at least SCALED_MM_MIN_ROWS bf16 rows go to torch._scaled_mm
(cuBLASLt's row-wise scaled FP8 GEMM); block scales, other dtypes and the few rows of decode
steps, to the Triton GEMM below, which applies a block's weight scale to its partial sum as it
walks K. GPUs before sm89 have no FP8 tensor cores: the reference dequantizes the weight there.
The activation quantization is a kernel of its own, not yet fused into the RMSNorm or
SiLU-and-mul before it."""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels import reference
from nanovllm.kernels.interpreter import INTERPRETER

FP8_MAX = reference.FP8_MAX
SCALED_MM_MIN_ROWS = 64  # below, the GEMM is bound by the weight read, which the Triton kernel does as well


@triton.jit
def _round_to_e4m3_mantissa(x):
    """x rounded to 3 mantissa bits, to nearest even: the interpreter's own FP8 conversion
    drops the carry into the exponent (126.8 becomes 64, not 128)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        if INTERPRETED:
            q = _round_to_e4m3_mantissa(q)
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]), x ~= q * scale row by row."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0),
                                       BLOCK=min(triton.next_power_of_2(k), 1024), INTERPRETED=INTERPRETER)
    return q, scale


@triton.jit
def _fp8_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                     stride_swn, stride_swk, HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                     SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # N on the first grid axis: decode steps have one row block and many column blocks.
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_w + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        if UPCAST:  # the interpreter has no FP8 dot
            a, b = a.to(tl.float32), b.to(tl.float32)
        part = tl.dot(a, b, out_dtype=tl.float32)
        if BLOCK_SCALES:  # BLOCK_K divides SCALE_K: one weight scale per column in this step
            s = tl.load(sw_ptr + (rn // SCALE_N) * stride_swn + (k0 // SCALE_K) * stride_swk, mask=rn < N, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    acc *= tl.load(sx_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if not BLOCK_SCALES:
        acc *= tl.load(sw_ptr + rn * stride_swn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ dequantized(weight)^T + bias, by the Triton kernel."""
    rows, k = xq.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=out_dtype, device=xq.device)
    block_m = 16 if rows <= 16 else 64
    block_n = 32 if rows <= 16 else 128
    block_k = 128 if block is None else min(128, block[1])
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_m))
    _fp8_gemm_kernel[grid](xq, x_scale, weight, scale, bias if bias is not None else y, y, rows, n, k,
                           xq.stride(0), weight.stride(0), y.stride(0), scale.stride(0), scale.stride(1),
                           HAS_BIAS=bias is not None, BLOCK_SCALES=block is not None,
                           SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, UPCAST=INTERPRETER,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return y


@functools.cache
def _fp8_matmuls_run(device: torch.device) -> bool:
    return INTERPRETER or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _fp8_matmuls_run(x.device):
        return reference.fp8_linear(x, weight, scale, block, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, x_scale = quantize_rows(x2)
    # cuBLASLt's row-wise scaled FP8 GEMM writes bf16 only.
    if block is None and x.dtype == torch.bfloat16 and x2.shape[0] >= SCALED_MM_MIN_ROWS and not INTERPRETER:
        # The bias is added apart: cuBLASLt's row-wise scaled kernels take none in every version.
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)
        if bias is not None:
            y += bias
    else:
        y = fp8_gemm(xq, x_scale, weight, scale, block, bias, x.dtype)
    return y.reshape(*shape[:-1], weight.shape[0])


def quantize_rows_float64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in float64 (the tests' reference)."""
    x64 = x.double()
    scale = x64.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x64 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_gemm_float64(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_gemm in float64 (the tests' reference)."""
    y = (xq.double() * x_scale.double()) @ reference.dequantize_fp8(weight, scale, block, torch.float64).T
    return y + bias.double() if bias is not None else y
