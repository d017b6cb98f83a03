"""Next-token sampling on the logits' device: kernels.sample draws every row in one sort-free
pass (greedy rows, temperature, min-p, top-k, top-p, seeded Gumbel-max noise, the allowed-token
bitmask) and returns the chosen token's log-probability on request. The noise of a row is keyed
by a seed the engine derives from the request's own seed and position, so a seeded request's
tokens do not depend on its batch."""
import torch
from torch import nn

from nanovllm import kernels
from nanovllm.kernels import reference


def top_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, n: int,
                 token_bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log-probabilities [B, n], token ids [B, n]): each row's n most likely tokens under
    log_softmax(logits / T) (T = 1 for greedy rows) with the tokens the bitmask disallows at
    -inf, as kernels.sample's logprobs. Callers pass only the rows that ask, so the others cost
    nothing."""
    scale = torch.where(temperatures > 0, temperatures, 1).float()[:, None]
    logits = reference.apply_token_bitmask(logits.float(), token_bitmask)
    return (logits / scale).log_softmax(dim=-1).topk(n, dim=-1)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, *filters,
                logprobs: bool = False, top_rows: torch.Tensor | None = None, num_top: int = 0, **rows):
        """logits [B, V]; temperatures [B] fp32; seeds [B] int64; `filters` and `rows`: the rest
        of kernels.sample's per-row inputs, passed through as given (SamplingInputs.tensors()
        makes them by name: top_ks / top_ps / min_ps [B] or None when no row uses that filter,
        max_top_k, token_bitmask int32 [B, ceil(V / 32)] or None). Returns (token ids [B], None),
        or with `logprobs` (token ids, (the chosen tokens' log-probabilities [B], top)): top is
        top_logprobs of the rows `top_rows` ([R] indices) with n = num_top, or None when
        top_rows is None."""
        tokens, chosen = kernels.sample(logits, temperatures, seeds, *filters, **rows, logprobs=logprobs)
        if not logprobs:
            return tokens, None
        top = None
        if top_rows is not None:
            bitmask = rows.get("token_bitmask")
            top = top_logprobs(logits[top_rows], temperatures[top_rows], num_top,
                               None if bitmask is None else bitmask[top_rows])
        return tokens, (chosen, top)
