"""Triton kernel for sampling with the Gumbel-max trick in one pass over the logits: each
program walks one row, adds Gumbel noise from Triton's Philox generator (keyed by the row's
seed and the token index) to logits / T, and keeps the running argmax. Temperature-0 rows
take the plain argmax. The eager equivalent makes six passes over a float32 copy."""
import torch
import triton
import triton.language as tl

_BLOCK = 2048
# Largest float32 below 1: u = 1 would make the noise +inf.
_U_MAX = 0.99999994


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, row_stride, vocab, temperatures_ptr, seeds_ptr, out_ptr,
                          BLOCK: tl.constexpr, U_MAX: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            u = tl.minimum(tl.rand(seed, cols), U_MAX)
            x = x / temperature - tl.log(-tl.log(u))
        better = x > best
        best = tl.where(better, x, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, axis=0)
    # the first index among ties, as torch.argmax gives
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_index, vocab), axis=0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
    _gumbel_argmax_kernel[(rows.shape[0],)](rows, rows.stride(0), rows.shape[1], temperatures, seeds, out,
                                            BLOCK=_BLOCK, U_MAX=_U_MAX, num_warps=8)
    return out
