"""Vocabulary-parallel embedding and LM head. Rank r of n holds the rows of token ids
[r * shard, (r + 1) * shard), shard = ceil(vocab_size / n); the last rank's rows past the
vocabulary are zero padding, so any vocabulary splits over any number of ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import distributed, kernels
from nanovllm.layers.linear import tensor_parallel_rank_and_size
from nanovllm.utils.loader import copy_checked


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"{name}: checkpoint has {loaded.shape[0]} vocabulary rows, the model {self.vocab_size}")
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[len(rows):].zero_()
        copy_checked(param.data[:len(rows)], rows, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each id has its row on one rank; the others contribute zeros to the sum.
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.shard_size)
        embeddings = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        return distributed.all_reduce(embeddings.masked_fill_(elsewhere.unsqueeze(-1), 0))


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits (in the model's dtype: the sampler reads
    them once and computes in fp32). With several ranks, each computes its vocabulary rows and
    rank 0, which samples, receives all of them; the other ranks get None."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = kernels.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        logits = distributed.gather_to_first(logits)
        return logits[:, :self.vocab_size] if logits is not None else None
