"""Per-step attention metadata, set by the model runner before a forward pass and read by
every attention layer, so that `forward` signatures carry only hidden states."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] query rows of each sequence
    seq_lens: torch.Tensor | None = None  # [B] cached + new tokens of each sequence
    block_tables: torch.Tensor | None = None  # [B, max_blocks] KV blocks of each sequence
    slot_mapping: torch.Tensor | None = None  # [T] cache slot of each new token, -1 to skip
    max_seqlen_q: int = 0


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**fields) -> None:
    global _CONTEXT
    _CONTEXT = Context(**fields)


def reset_context() -> None:
    set_context()
