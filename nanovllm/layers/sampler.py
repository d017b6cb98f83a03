"""Next-token sampling on the logits' device: greedy for temperature 0, otherwise top-k, top-p
and a draw from the softmax by the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which needs no cumulative sums. A seeded request draws its noise from its own generator, so
its tokens do not depend on what else is in the batch."""
import torch
from torch import nn


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Masks to -inf every logit outside each row's top-k, then outside the smallest set of
    the remaining tokens whose probability reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    outside = ranks[None, :] >= top_ks[:, None]
    probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    outside |= mass_before >= top_ps[:, None]
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(outside, float("-inf")))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None = None,
                top_ps: torch.Tensor | None = None, generators: dict[int, torch.Generator] | None = None):
        """logits [B, V] fp32; temperatures [B]; top_ks/top_ps [B] or None when no row filters;
        generators: row -> generator for seeded rows. Returns token ids [B]."""
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp_min(1e-6)[:, None]
        if top_ks is not None:
            scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in (generators or {}).items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
