"""Next-token sampling on the logits' device: kernels.sample draws every row in one sort-free
pass (penalties, the allowed-token bitmask, greedy rows, temperature, min-p, top-k, top-p,
seeded Gumbel-max noise) and returns the chosen token's log-probability on request. Sparse
edits (logit biases, banned tokens) are added to the logits first. The noise of a row is keyed
by a seed the engine derives from the request's own seed and position, so a seeded request's
tokens do not depend on its batch."""
import torch
from torch import nn

from nanovllm import kernels
from nanovllm.kernels import penalties as penalty_ops
from nanovllm.kernels import reference


def top_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, n: int, token_bitmask: torch.Tensor | None = None,
                 penalties: penalty_ops.Penalties | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log-probabilities [B, n], token ids [B, n]): each row's n most likely tokens under
    log_softmax(logits / T) (T = 1 for greedy rows) of the penalized logits with the tokens the
    bitmask disallows at -inf, as kernels.sample's logprobs. Callers pass only the rows that
    ask, so the others cost nothing."""
    scale = torch.where(temperatures > 0, temperatures, 1).float()[:, None]
    logits = reference.apply_token_bitmask(penalty_ops.apply(logits.float(), penalties), token_bitmask)
    return (logits / scale).log_softmax(dim=-1).topk(n, dim=-1)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, *filters,
                logprobs: bool = False, top_rows: torch.Tensor | None = None, num_top: int = 0,
                logit_edits=None, **rows):
        """logits [B, V] (edited in place); temperatures [B] fp32; seeds [B] int64; `filters`
        and `rows`: the rest of kernels.sample's per-row inputs, passed through as given
        (SamplingInputs.tensors() makes them by name: top_ks / top_ps / min_ps [B] or None when
        no row uses that filter, max_top_k, token_bitmask int32 [B, ceil(V / 32)] or None,
        penalties or None). logit_edits: (rows, token ids, values) added to the logits first,
        or None. Returns (token ids [B], None), or with `logprobs` (token ids, (the chosen
        tokens' log-probabilities [B], top)): top is top_logprobs of the rows `top_rows` ([R]
        indices) with n = num_top, or None when top_rows is None."""
        penalty_ops.add_logit_edits(logits, logit_edits)
        top = None
        if logprobs and top_rows is not None:  # before the draw, which counts its tokens in the penalties' tables
            top = top_logprobs(logits[top_rows], temperatures[top_rows], num_top, *_rows_of(rows, top_rows))
        tokens, chosen = kernels.sample(logits, temperatures, seeds, *filters, **rows, logprobs=logprobs)
        return (tokens, (chosen, top)) if logprobs else (tokens, None)


def _rows_of(rows: dict, index: torch.Tensor) -> tuple:
    """The token bitmask and penalties of the rows `index`."""
    bitmask, penalties = rows.get("token_bitmask"), rows.get("penalties")
    if penalties is not None:
        penalties = penalty_ops.Penalties(penalties.rows[index], penalties.presence[index],
                                          penalties.frequency[index], penalties.repetition[index], penalties.counts,
                                          penalties.prompt)
    return None if bitmask is None else bitmask[index], penalties
