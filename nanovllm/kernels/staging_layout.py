"""The host side of staging.py: the layout of a staging slot, which the host fills and
`stage_inputs` reads, and the checked `stage_inputs` and `publish_tokens`."""
import itertools

import torch

from nanovllm.kernels.checks import require
from nanovllm.kernels.dispatch import implementation

# Values of a staging slot that stage_inputs reads before it knows which slot is the step's: a
# slot holds at least this many.
STAGE_SLOT_MIN = 256


def staged_values(token_rows: list[list[int]], seq_rows: list[list[int]], block_tables: list[list[int]]) -> list[int]:
    """A step's inputs in the layout stage_inputs reads from a slot (kernels/staging.py): three
    per-token rows (input ids, an id below 0 being -1 - the index of a token sampled last;
    positions; slot mapping), four per-sequence rows of one more value (sequence lengths,
    cu_seqlens_q, sampling seeds, temperatures as float32 bits) and the block tables, all of
    equal width."""
    width = len(block_tables[0]) if block_tables else 0
    return [len(block_tables), width, *itertools.chain(*token_rows, *seq_rows, *block_tables)]


def staged_length(num_tokens: int, num_seqs: int, table_values: int) -> int:
    """The columns a slot needs for steps of up to these sizes (staged_values' values, at least
    STAGE_SLOT_MIN)."""
    return max(2 + 3 * num_tokens + 4 * (num_seqs + 1) + table_values, STAGE_SLOT_MIN)


def stage_inputs(slots: torch.Tensor, parity: torch.Tensor, samples: torch.Tensor, token_rows: torch.Tensor,
                 seq_rows: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, num_seqs: int) -> None:
    """Places the step that the host wrote (staged_values) into slot `parity` of `slots`
    (int32 [2, >= STAGE_SLOT_MIN], pinned for CUDA) into a graph's inputs: token_rows[:, :num_tokens]
    (int64 [3, T]), seq_rows[:, :num_seqs + 1] (int32 [4, S]) and the block tables' leading
    rows and columns (int32 [S, W]), input ids below 0 taken from samples (int64); then flips
    parity (int32 [1], on the inputs' device). The host must not write a slot that a launch
    may still read: double buffering, kernels/staging.py."""
    require(isinstance(slots, torch.Tensor) and slots.dtype == torch.int32 and slots.dim() == 2
            and slots.shape[0] == 2 and slots.shape[1] >= STAGE_SLOT_MIN and slots.stride(1) == 1, "slots",
            lambda: f"must be a row-contiguous int32 tensor [2, >= {STAGE_SLOT_MIN}]")
    require(parity.dtype == torch.int32 and parity.numel() == 1, "parity", "must be one int32")
    require(samples.dtype == torch.int64, "samples", "must be int64")
    require(token_rows.dtype == torch.int64 and token_rows.dim() == 2 and token_rows.shape[0] == 3
            and num_tokens <= token_rows.shape[1], "token_rows", lambda: f"must be int64 [3, >= {num_tokens}]")
    require(seq_rows.dtype == torch.int32 and seq_rows.dim() == 2 and seq_rows.shape[0] == 4
            and num_seqs < seq_rows.shape[1], "seq_rows", lambda: f"must be int32 [4, > {num_seqs}]")
    require(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] >= num_seqs,
            "block_tables", lambda: f"must be int32 [>= {num_seqs}, width]")
    for name, t in (("token_rows", token_rows), ("seq_rows", seq_rows), ("block_tables", block_tables)):
        require(t.stride(1) == 1, name, "rows must be contiguous")
    implementation("stage_inputs", token_rows.device)(slots, parity, samples, token_rows, seq_rows, block_tables,
                                                      num_tokens, num_seqs)


def publish_tokens(tokens: torch.Tensor, last: torch.Tensor, host_slots: torch.Tensor, parity: torch.Tensor) -> None:
    """Stores sampled token ids (int64 [n]) into last[:n], where the next step's input ids
    below 0 read them, and into row `parity` of host_slots (int64 [2, >= n], pinned for CUDA),
    then flips parity (int32 [1], on the tokens' device)."""
    n = tokens.shape[0]
    require(tokens.dtype == torch.int64 and tokens.dim() == 1 and tokens.is_contiguous(), "tokens",
            "must be a contiguous int64 vector")
    require(last.dtype == torch.int64 and last.shape[0] >= n, "last", lambda: f"must be int64 [>= {n}]")
    require(host_slots.dtype == torch.int64 and host_slots.dim() == 2 and host_slots.shape[0] == 2
            and host_slots.shape[1] >= n and host_slots.stride(1) == 1, "host_slots",
            lambda: f"must be int64 [2, >= {n}]")
    require(parity.dtype == torch.int32 and parity.numel() == 1, "parity", "must be one int32")
    implementation("publish_tokens", tokens.device)(tokens, last, host_slots, parity)
