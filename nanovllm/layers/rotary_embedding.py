"""Neox-style rotary embedding's cos/sin table, with the rope scaling variants of Llama-family
checkpoints. A variant changes only the inverse frequencies the table is built from; the
kernels that rotate q and k (kernels.qk_norm_rope_store) read the table alike for all."""
import math

import torch
from torch import nn

# rope_type -> the parameters its scaling reads (transformers' names)
ROPE_SCALING_PARAMETERS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies base^(-2i / head_dim), scaled as `scaling`
    ({"rope_type": ..., its parameters}; None: unscaled) says.

    linear: every frequency divided by `factor` (positions interpolated).
    llama3 (Llama 3.1+): wavelengths above original_max_position_embeddings / low_freq_factor
        divided by `factor`, below original_max_position_embeddings / high_freq_factor kept,
        blended linearly in 1 / wavelength between the two.
    dynamic (NTK): transformers raises the base only while a sequence is longer than
        max_position_embeddings and uses the unscaled frequencies up to that length. The engine
        never runs a sequence that long (max_model_len is capped at max_position_embeddings),
        so its table holds the unscaled frequencies, equal to transformers' at every length
        the engine serves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def build_cos_sin_cache(head_dim: int, max_position: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos(p * f) in the first half, sin(p * f) in the second."""
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inverse_frequencies(head_dim, base, scaling))
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


class RotaryEmbedding(nn.Module):
    """The cos/sin table of neox-style rotary embedding. Attention applies it, in the kernel
    that also writes the cache (kernels.qk_norm_rope_store). One table serves every layer."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        # fp32 whatever the model's dtype: the model is built in its dtype, never cast afterwards.
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_position, base, scaling),
                             persistent=False)
