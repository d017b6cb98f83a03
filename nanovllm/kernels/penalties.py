"""Repetition, frequency and presence penalties as kernels.sample takes them: per-row values and
the tables of token counts they read, kept on the device by the engine (one table row per
penalized request) and updated by the sampler after each draw. Also the sparse logit edits
(biases, bans) the sampler adds before a draw."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Penalties:
    """rows: int32 [B], each batch row's row in the tables, -1 for a row without penalties.
    presence, frequency, repetition: float32 [B]. counts: int32 [R, V], each output token's
    count. prompt: int32 [R, ceil(V / 32)], the prompt's tokens as a bitmask (bit v % 32 of
    word v // 32). A penalized row's logit x of token v becomes, with c = counts[v] and `seen`
    = c > 0 or v in the prompt: x / repetition (x > 0) or x * repetition (x <= 0) where seen,
    then minus frequency * c + presence * (c > 0)."""
    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    counts: torch.Tensor
    prompt: torch.Tensor


def apply(logits: torch.Tensor, penalties: Penalties | None) -> torch.Tensor:
    """The penalized logits (a new tensor in logits' dtype; `logits` as it is without penalties)."""
    if penalties is None:
        return logits
    held = penalties.rows >= 0
    table_rows = penalties.rows.clamp(min=0).long()
    counts = penalties.counts[table_rows, :logits.shape[1]].to(logits.dtype)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    in_prompt = ((penalties.prompt[table_rows][:, :, None] >> bits) & 1).flatten(1)[:, :logits.shape[1]].bool()
    seen = (counts > 0) | in_prompt
    repetition = penalties.repetition.to(logits.dtype)[:, None]
    x = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    frequency, presence = penalties.frequency.to(logits.dtype)[:, None], penalties.presence.to(logits.dtype)[:, None]
    x = x - frequency * counts - presence * (counts > 0)
    return torch.where(held[:, None], x, logits)


def record(penalties: Penalties | None, tokens: torch.Tensor) -> None:
    """Counts the drawn tokens (int64 [B]) in the rows' tables."""
    if penalties is None:
        return
    held = penalties.rows >= 0
    rows = torch.where(held, penalties.rows, 0).long()
    penalties.counts.index_put_((rows, tokens), held.to(penalties.counts.dtype), accumulate=True)


def add_logit_edits(logits: torch.Tensor, logit_edits) -> None:
    """Adds (rows, token ids, values) to the logits in place: a scatter over the edited entries
    alone (biases; -inf bans). Repeated entries add up."""
    if logit_edits is not None:
        rows, ids, values = logit_edits
        logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
