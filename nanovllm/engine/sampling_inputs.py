"""The per-row inputs of a step's draws, from each sampled sequence's SamplingParams: built once
on the host, then copied to the device for an eager draw (`tensors`) or staged into the slot of
a CUDA graph that draws (`staged_rows`). A new sampling parameter is one more field here, read
by the sampler kernel (a per-row value, or a sparse logit edit: see logit_edits)."""
import random
import struct

import torch
import xxhash

from nanovllm.engine.sequence import PLACEHOLDER
from nanovllm.kernels.penalties import Penalties
from nanovllm.sampling_params import GREEDY_TEMPERATURE


def temperature(params) -> float:
    # Every sampling path sees 0 for a near-zero temperature, where logits / T would overflow.
    return params.temperature if params.temperature >= GREEDY_TEMPERATURE else 0.0


def ranks(params) -> bool:
    """Whether the draw keeps only the top tokens (top-k or top-p), which the sampler ranks."""
    return params.top_k != -1 or params.top_p < 1


def edits(params) -> bool:
    """Whether the logits are edited before the draw: biases, bans, penalties."""
    return bool(params.penalized or params.logit_bias or params.min_tokens or params.bad_words_token_ids)


def plain(params) -> bool:
    """A draw without filters, edits, a grammar's token bitmask or log-probabilities: the one a
    CUDA graph may take."""
    return (params.logprobs is None and not ranks(params) and params.min_p <= 0 and not edits(params)
            and params.structured_outputs is None)


class SamplingInputs:
    """`seqs`: the sequences a step samples, in their rows' order. Unseeded rows take noise
    seeds from `noise_rng`; `vocab_size` stands in for a top_k of -1 beside rows that rank.
    `counts`: the runner's TokenCounts, for penalized rows. `pending(seq)`: the row in the
    runner's last_tokens of the sequence's last token while it is still on the device."""

    def __init__(self, seqs, vocab_size: int, noise_rng: random.Random, counts=None, pending=None):
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
        self.penalty_rows = self.edits = None
        if not self.plain:
            if any(p.penalized for p in params):
                self.penalty_rows = counts.rows_of(seqs)
                self.penalty_values = [[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                       [p.repetition_penalty for p in params]]
            if any(edits(p) for p in params):  # a speculative step's draws never edit (speculative.speculates)
                self.edits = logit_edits(seqs, pending)
        self.counts = counts

    def tensors(self, to_device, last_tokens: torch.Tensor | None = None) -> dict:
        """The Sampler's keyword arguments; `to_device(values, dtype)` makes a device tensor.
        `last_tokens`: the runner's, where edits depend on a token still on the device."""
        inputs = dict(temperatures=to_device(self.temperatures, torch.float32), seeds=to_device(self.seeds, torch.long),
                      top_ks=None if self.top_ks is None else to_device(self.top_ks, torch.long),
                      top_ps=None if self.top_ps is None else to_device(self.top_ps, torch.float32),
                      min_ps=None if self.min_ps is None else to_device(self.min_ps, torch.float32),
                      max_top_k=self.max_top_k)
        if self.penalty_rows is not None:
            # a tensor each: rows of one [3, B] tensor start 4 B bytes apart, so their alignment, which
            # Triton compiles a variant for, would change with the row count the warm-up cannot cover
            values = [to_device(row, torch.float32) for row in self.penalty_values]
            inputs["penalties"] = Penalties(to_device(self.penalty_rows, torch.int32), *values,
                                            self.counts.counts, self.counts.prompt)
        if self.edits:
            rows, ids, values, after_rows, after_tokens = self.edits
            values = to_device(values, torch.float32)
            if any(row >= 0 for row in after_rows):  # a ban that holds only if the token in flight is the one named
                after_rows, after_tokens = to_device(after_rows, torch.long), to_device(after_tokens, torch.long)
                holds = (after_rows < 0) | (last_tokens[after_rows.clamp(min=0)] == after_tokens)
                values = torch.where(holds, values, 0)
            inputs["logit_edits"] = (to_device(rows, torch.long), to_device(ids, torch.long), values)
        return inputs

    def staged_rows(self, rows: int) -> list[list[int]]:
        """The noise seeds and the temperatures (float32 bits) of a graph of `rows` sequence
        rows, in the staging layout (kernels.staged_values); padding rows draw greedily."""
        pad = rows - len(self.seeds)
        temperatures = self.temperatures + [0.0] * pad
        return [self.seeds + [0] * pad, list(struct.unpack(f"{rows}i", struct.pack(f"{rows}f", *temperatures)))]


def logit_edits(seqs, pending) -> tuple | None:
    """(rows, token ids, values, after_rows, after_tokens) of the step's sparse edits: each
    row's logit biases; -inf for its EOS and stop ids while it has fewer than min_tokens
    output tokens, and for its bad words' last tokens where the output ends with the rest of
    the word. A ban on a word whose last known token is still on the device holds only if that
    token (last_tokens[after_row]) is after_token; after_row is -1 elsewhere."""
    rows, ids, values, after_rows, after_tokens = [], [], [], [], []

    def add(row, token, value, after_row=-1, after_token=-1):
        rows.append(row)
        ids.append(token)
        values.append(value)
        after_rows.append(after_row)
        after_tokens.append(after_token)

    for row, seq in enumerate(seqs):
        p = seq.params
        for token, bias in (p.logit_bias or {}).items():
            add(row, token, bias)
        if seq.num_output_tokens < p.min_tokens:
            for token in p.min_tokens_stop_ids:
                add(row, token, float("-inf"))
        output = seq.token_ids[seq.num_prompt_tokens:]
        for word in p.bad_words_token_ids:
            *prefix, last = word
            if len(output) < len(prefix):
                continue
            tail = output[len(output) - len(prefix):]
            if tail and tail[-1] == PLACEHOLDER:
                if tail[:-1] == prefix[:-1]:
                    add(row, last, float("-inf"), pending(seq), prefix[-1])
            elif tail == prefix:
                add(row, last, float("-inf"))
    return (rows, ids, values, after_rows, after_tokens) if rows else None


class TokenCounts:
    """The device tables of penalized requests, a row each: `counts` int32 [rows, V], each
    output token's count, and `prompt` int32 [rows, ceil(V / 32)], the prompt's tokens as a
    bitmask. A request's row is filled when it first samples and kept through preemption (its
    output tokens stay); the sampler counts each draw. Rows of finished requests are reused;
    the tables grow by doubling and are dropped once no request holds a row, so only requests
    with penalties cost memory: 4 V + V / 8 bytes a row."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = self.prompt = None
        self.held: dict[int, tuple[int, object]] = {}  # request id -> (row, sequence)
        self.free: list[int] = []

    def rows_of(self, seqs) -> list[int]:
        """Each sequence's row, -1 for those without penalties."""
        return [self._row(seq) if seq.params.penalized else -1 for seq in seqs]

    def release_finished(self) -> None:
        for request_id, (row, seq) in list(self.held.items()):
            if seq.is_finished:
                del self.held[request_id]
                self.free.append(row)
        if not self.held and self.counts is not None:
            self.counts = self.prompt = None
            self.free = []

    def _row(self, seq) -> int:
        if seq.request_id in self.held:
            return self.held[seq.request_id][0]
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.held[seq.request_id] = (row, seq)
        output = [t for t in seq.token_ids[seq.num_prompt_tokens:] if t != PLACEHOLDER]
        self.counts[row] = torch.bincount(torch.tensor(output, dtype=torch.long),
                                          minlength=self.vocab_size).to(self.device, torch.int32)
        self.prompt[row] = pack_token_set(seq.token_ids[:seq.num_prompt_tokens], self.vocab_size).to(self.device)
        return row

    def _grow(self) -> None:
        size = 0 if self.counts is None else self.counts.shape[0]
        new = max(1, 2 * size)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, -(-self.vocab_size // 32), dtype=torch.int32, device=self.device)
        if size:
            counts[:size], prompt[:size] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self.free.extend(range(new - 1, size - 1, -1))


def pack_token_set(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V / 32)]: bit t % 32 of word t // 32 set for each token t."""
    unique = torch.tensor(sorted(set(tokens)), dtype=torch.long)
    words = torch.zeros(-(-vocab_size // 32), dtype=torch.long)
    words.index_add_(0, unique // 32, torch.ones_like(unique) << (unique % 32))
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def noise_seed(seq, noise_rng: random.Random) -> int:
    """The sampling noise key of a sequence's next token: from its seed and position when it
    has one (the same token in any batch, across preemptions), else fresh."""
    if seq.params.seed is None:
        return noise_rng.getrandbits(31)
    return xxhash.xxh32_intdigest(f"{seq.params.seed}:{seq.num_output_tokens}".encode()) & 0x7FFFFFFF
