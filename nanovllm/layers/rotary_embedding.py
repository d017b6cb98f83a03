import torch
from torch import nn


def build_cos_sin_cache(head_dim: int, max_position: int, base: float) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos(p * f) in the first half, sin(p * f) in the second."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


class RotaryEmbedding(nn.Module):
    """The cos/sin table of neox-style rotary embedding. Attention applies it, in the kernel
    that also writes the cache (kernels.qk_norm_rope_store)."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        # fp32 whatever the model's dtype: the model is built in its dtype, never cast afterwards.
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_position, base), persistent=False)
