"""Next-token sampling on the logits' device: kernels.sample draws every row in one sort-free
pass (greedy rows, temperature, min-p, top-k, top-p, seeded Gumbel-max noise) and returns the
chosen token's log-probability on request. The noise of a row is keyed by a seed the engine
derives from the request's own seed and position, so a seeded request's tokens do not depend
on its batch."""
import torch
from torch import nn

from nanovllm import kernels


def top_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log-probabilities [B, n], token ids [B, n]): each row's n most likely tokens under
    log_softmax(logits / T) (T = 1 for greedy rows), as kernels.sample's logprobs. Callers pass
    only the rows that ask, so the others cost nothing."""
    scale = torch.where(temperatures > 0, temperatures, 1).float()[:, None]
    return (logits.float() / scale).log_softmax(dim=-1).topk(n, dim=-1)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None,
                min_ps: torch.Tensor | None = None, max_top_k: int | None = None, logprobs: bool = False,
                top_rows: torch.Tensor | None = None, num_top: int = 0):
        """logits [B, V]; temperatures [B] fp32; seeds [B] int64; top_ks / top_ps / min_ps [B] or
        None when no row uses that filter; max_top_k as kernels.sample takes it. Returns (token
        ids [B], None), or with `logprobs` (token ids, (the chosen tokens' log-probabilities [B],
        top)): top is top_logprobs of the rows `top_rows` ([R] indices) with n = num_top, or
        None when top_rows is None."""
        tokens, chosen = kernels.sample(logits, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=max_top_k,
                                        logprobs=logprobs)
        if not logprobs:
            return tokens, None
        top = None if top_rows is None else top_logprobs(logits[top_rows], temperatures[top_rows], num_top)
        return tokens, (chosen, top)
