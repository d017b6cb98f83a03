import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import kernels


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits (in the model's dtype: the sampler reads
    them once and computes in fp32)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.linear(hidden_states, self.weight)
