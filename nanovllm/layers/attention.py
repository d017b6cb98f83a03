import torch
from torch import nn

from nanovllm import kernels
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Writes this step's keys and values into the paged cache, then attends over it. The
    cache tensors are attached by the model runner once it has sized them."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        kernels.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        return kernels.paged_attention(
            q, self.k_cache, self.v_cache, cu_seqlens_q=context.cu_seqlens_q, seq_lens=context.seq_lens,
            block_tables=context.block_tables, max_seqlen_q=context.max_seqlen_q, scale=self.scale)
