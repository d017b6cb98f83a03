import torch
from torch import nn

from nanovllm import kernels
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Rotates this step's queries and keys (after Qwen3's per-head norms, when given), writes
    keys and values into the paged cache and attends over the cache: two kernels, or one for
    decode steps of a few sequences (kernels.qk_norm_rope_attention). The cache tensors are
    attached by the model runner once it has sized them. `sliding_window` (Mistral): a query
    sees only that many keys, ending at its own; a plain int handed to the kernel on every
    call, so a captured CUDA graph holds it too. `k_scale` and `v_scale` (plain floats as well):
    a float8 cache's per-tensor scales, set by the model runner (1.0 unless the checkpoint has
    them)."""

    def __init__(self, scale: float, sliding_window: int | None = None):
        super().__init__()
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        context = get_context()
        norm_weights = dict(q_weight=q_norm.weight, k_weight=k_norm.weight, eps=q_norm.eps) if q_norm else {}
        return kernels.qk_norm_rope_attention(
            q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache, context.slot_mapping,
            cu_seqlens_q=context.cu_seqlens_q, seq_lens=context.seq_lens, block_tables=context.block_tables,
            max_seqlen_q=context.max_seqlen_q, scale=self.scale, sliding_window=self.sliding_window,
            k_scale=self.k_scale, v_scale=self.v_scale, **norm_weights)
