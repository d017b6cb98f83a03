"""The CUDA C++ paged decode kernel (paged_decode.cu): kernels/attention.py runs it for decode
steps whose grid it does not split, where `supports` holds and the kernel builds; the Triton
kernel serves everything else. Its key loop waits on no other warp and keeps three chunks'
loads in flight a warp while it scores one, which Triton 3.6's pipeliner does not
(docs/attention.md)."""
import torch

from nanovllm.kernels import cuda

_DECLARATIONS = """
#include <torch/extension.h>
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                  torch::Tensor cu_seqlens_q, torch::Tensor seq_lens, torch::Tensor block_tables, double qk_scale,
                  double v_scale, bool pdl);
"""
HEAD_DIM = 64
MAX_GROUP = 16  # query heads of a kv head: the MMA's 16 rows
CHUNK = 16  # keys a warp takes at a time; cache blocks must hold whole chunks
LOG2E = 1.4426950408889634


def module():
    return cuda.load("nanovllm_paged_decode", "paged_decode.cu", _DECLARATIONS, ("paged_decode",))


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    """16-byte loads: the data and every row the kernel starts a load at are 16-byte aligned."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in strides)


def supports(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables) -> bool:
    """Whether the kernel serves these decode operands (kernels.paged_attention has checked
    their shapes): 16-bit floats on a GPU with bf16 tensor cores, caches of q's dtype or
    float8 e4m3, heads of 64, at most 16 query heads a kv head, cache blocks of whole chunks,
    int32 step metadata, all on q's device, rows the kernel can read 16 bytes at a time."""
    return (q.is_cuda and all(t.device == q.device for t in (k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables))
            and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and q.shape[2] == HEAD_DIM and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
            and k_cache.shape[1] % CHUNK == 0
            and all(t.dtype == torch.int32 for t in (cu_seqlens_q, seq_lens, block_tables))
            and cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1
            and q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1 and _aligned(q, q.stride(0), q.stride(1))
            and _aligned(k_cache, *k_cache.stride()[:3]) and _aligned(v_cache, *v_cache.stride()[:3])
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def paged_decode(ext, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale: float, k_scale: float,
                 v_scale: float, pdl: bool) -> torch.Tensor:
    """Attention of each sequence's one query row (or none) over its cached keys (a float8
    cache's times k_scale and v_scale); `ext` is module()'s. Rows no sequence owns are left
    unwritten."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ext.paged_decode(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale * k_scale * LOG2E, v_scale,
                     pdl)
    return out
