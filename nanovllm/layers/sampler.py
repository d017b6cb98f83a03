"""Next-token sampling on the logits' device: greedy for temperature 0, otherwise top-k, top-p
and a draw from softmax(logits / T) by the Gumbel-max trick (kernels.gumbel_sample: one pass
over the logits, no softmax). The noise of a row is keyed by a seed the engine derives from
the request's own seed and position, so a seeded request's tokens do not depend on its batch."""
import torch
from torch import nn

from nanovllm import kernels


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Masks to -inf every logit outside each row's top-k, then outside the smallest set of
    the remaining tokens whose probability reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    outside = ranks[None, :] >= top_ks[:, None]
    probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 keeps everything: fp32 cumulative sums can reach 1.0 before the tail
    outside |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(outside, float("-inf")))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V]; temperatures [B] fp32; seeds [B] int64; top_ks/top_ps [B] or None when
        no row filters. Returns token ids [B]."""
        if top_ks is not None:
            # Filter the tempered distribution; the kernel then draws from what is left at T = 1.
            tempered = logits.float() / temperatures.clamp_min(1e-6)[:, None]
            logits = apply_top_k_top_p(tempered, top_ks, top_ps)
            temperatures = (temperatures > 0).float()
        return kernels.gumbel_sample(logits, temperatures, seeds)
