"""Next-token sampling on the logits' device: greedy for temperature 0, otherwise top-k, top-p
and a draw from softmax(logits / T) by the Gumbel-max trick: argmax(logits / T + G) with
G = -log(-log U), U ~ U(0, 1), is a draw from the softmax, which is never computed (at 256 rows
of a 152k vocabulary each full pass over the logits costs about 0.1 ms on an H200; on the CPU
uniform_ plus two logs is 5x faster than exponential_). A seeded request draws its noise from
its own generator, so its tokens do not depend on its batch."""
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
                top_ps: torch.Tensor | None = None, generators: dict[int, torch.Generator] | None = None,
                greedy_rows: str = "some"):
        """logits [B, V] fp32, overwritten; temperatures [B]; top_ks/top_ps [B] or None when no
        row filters; generators: row -> generator for seeded rows; greedy_rows: "all", "none" or
        "some" of the rows have temperature 0 (each answer skips a pass over the logits).
        Returns token ids [B]."""
        if greedy_rows == "all":
            return logits.argmax(dim=-1)
        greedy = logits.argmax(dim=-1) if greedy_rows == "some" else None
        scaled = logits.div_(temperatures.clamp_min(1e-6)[:, None])
        if top_ks is not None:
            scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
        uniform = torch.empty_like(scaled).uniform_()
        for row, generator in (generators or {}).items():
            uniform[row].uniform_(generator=generator)
        # log(-log U) = -G; U = 0 gives -inf for that token, never a winner
        sampled = scaled.sub_(uniform.log_().neg_().log_()).argmax(dim=-1)
        return sampled if greedy is None else torch.where(temperatures == 0, greedy, sampled)
