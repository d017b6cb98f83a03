"""The per-row inputs of a step's draws, from each sampled sequence's SamplingParams: built once
on the host, then copied to the device for an eager draw (`tensors`) or staged into the slot of
a CUDA graph that draws (`staged_rows`). A new sampling parameter is one more field here, read
by the sampler kernel."""
import random
import struct

import torch
import xxhash

from nanovllm.sampling_params import GREEDY_TEMPERATURE


def temperature(params) -> float:
    # Every sampling path sees 0 for a near-zero temperature, where logits / T would overflow.
    return params.temperature if params.temperature >= GREEDY_TEMPERATURE else 0.0


def ranks(params) -> bool:
    """Whether the draw keeps only the top tokens (top-k or top-p), which the sampler ranks."""
    return params.top_k != -1 or params.top_p < 1


def plain(params) -> bool:
    """A draw without filters, log-probabilities or a token bitmask: the one a CUDA graph may take."""
    return (params.logprobs is None and not ranks(params) and params.min_p <= 0
            and params.structured_outputs is None)


class SamplingInputs:
    """`seqs`: the sequences a step samples, in their rows' order. Unseeded rows take noise
    seeds from `noise_rng`; `vocab_size` stands in for a top_k of -1 beside rows that rank."""

    def __init__(self, seqs, vocab_size: int, noise_rng: random.Random):
        params = [seq.params for seq in seqs]
        self.temperatures = [temperature(p) for p in params]
        self.seeds = [noise_seed(seq, noise_rng) for seq in seqs]
        self.min_ps = [p.min_p for p in params] if any(p.min_p > 0 for p in params) else None
        self.top_ks = self.top_ps = self.max_top_k = None
        if any(ranks(p) for p in params):
            self.top_ks = [p.top_k if p.top_k != -1 else vocab_size for p in params]
            self.top_ps = [p.top_p for p in params]
            # how many tokens a row's top-k / top-p may keep: the sampler's sort-free bound
            self.max_top_k = max(k for p, k in zip(params, self.top_ks) if ranks(p))
        self.plain = all(plain(p) for p in params)

    def tensors(self, to_device) -> dict:
        """The Sampler's keyword arguments; `to_device(values, dtype)` makes a device tensor."""
        return dict(temperatures=to_device(self.temperatures, torch.float32), seeds=to_device(self.seeds, torch.long),
                    top_ks=None if self.top_ks is None else to_device(self.top_ks, torch.long),
                    top_ps=None if self.top_ps is None else to_device(self.top_ps, torch.float32),
                    min_ps=None if self.min_ps is None else to_device(self.min_ps, torch.float32),
                    max_top_k=self.max_top_k)

    def staged_rows(self, rows: int) -> list[list[int]]:
        """The noise seeds and the temperatures (float32 bits) of a graph of `rows` sequence
        rows, in the staging layout (kernels.staged_values); padding rows draw greedily."""
        pad = rows - len(self.seeds)
        temperatures = self.temperatures + [0.0] * pad
        return [self.seeds + [0] * pad, list(struct.unpack(f"{rows}i", struct.pack(f"{rows}f", *temperatures)))]


def noise_seed(seq, noise_rng: random.Random) -> int:
    """The sampling noise key of a sequence's next token: from its seed and position when it
    has one (the same token in any batch, across preemptions), else fresh."""
    if seq.params.seed is None:
        return noise_rng.getrandbits(31)
    return xxhash.xxh32_intdigest(f"{seq.params.seed}:{seq.num_output_tokens}".encode()) & 0x7FFFFFFF
