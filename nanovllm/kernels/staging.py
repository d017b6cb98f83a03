"""Triton kernels that carry a step's inputs into a CUDA graph and its sampled tokens out of
it without the copy engines: the host writes the inputs into pinned memory, which the graph's
first kernel reads over the bus, and a kernel stores the sampled tokens into pinned memory.
Between kernels, each copy-engine transfer costs a step several microseconds where a load or
store over the bus costs about one round trip.

Both sides are double-buffered: pinned `[2, capacity]` slots, so the host can write one while
the GPU still reads the other. Which slot a launch uses is a parity in device memory that the
launch flips (one program: no other program reads it meanwhile). The host knows it by
counting launches, and it must not write a slot before the launch two back has finished with it.

A staged slot (int32): the block tables' row count and width, then three rows
of `num_tokens` (input ids, positions, slot mapping), four rows of `num_seqs` + 1 (sequence
lengths, cu_seqlens_q, sampling seeds, temperatures as float32 bits), then the block tables
row by row. An input id below 0 is -1 - i: the step's token i sampled last, read from
`samples` on the device.

stage_inputs is a graph's first kernel, with no kernel of the step before it: it is launched
without programmatic dependent launch. publish_tokens follows the sampler's kernels and is
launched with it."""
import triton
import triton.language as tl

from nanovllm.kernels.staging_layout import STAGE_SLOT_MIN
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch, fast_launch

HEADER = tl.constexpr(2)  # the block tables' row count and width
STAGE_BLOCK = 4096  # values a loop step reads past the first STAGE_SLOT_MIN
PUBLISH_BLOCK = 1024


@triton.jit
def _place(values, index, used, num_tokens, num_seqs, width, samples_ptr, token_rows_ptr, token_row_stride,
           seq_rows_ptr, seq_row_stride, tables_ptr, table_row_stride):
    """Stores the slot's values at offsets `index` into the graph's inputs."""
    t = index - HEADER
    in_tokens = (index < used) & (t >= 0) & (t < 3 * num_tokens)
    row, col = t // num_tokens, t % num_tokens
    deferred = in_tokens & (row == 0) & (values < 0)
    sampled = tl.load(samples_ptr + (-1 - values), mask=deferred, other=0)
    tl.store(token_rows_ptr + row * token_row_stride + col, tl.where(deferred, sampled, values.to(tl.int64)),
             mask=in_tokens)
    s = t - 3 * num_tokens
    in_seqs = (index < used) & (s >= 0) & (s < 4 * (num_seqs + 1))
    tl.store(seq_rows_ptr + (s // (num_seqs + 1)) * seq_row_stride + s % (num_seqs + 1), values, mask=in_seqs)
    b = s - 4 * (num_seqs + 1)
    in_tables = (index < used) & (b >= 0)
    tl.store(tables_ptr + (b // width) * table_row_stride + b % width, values, mask=in_tables)


@fast_launch
@triton.jit
def _stage_kernel(slots_ptr, slot_stride, parity_ptr, samples_ptr, token_rows_ptr, token_row_stride,
                  seq_rows_ptr, seq_row_stride, tables_ptr, table_row_stride, num_tokens, num_seqs,
                  FIRST: tl.constexpr, BLOCK: tl.constexpr):
    parity = tl.load(parity_ptr)
    first = tl.arange(0, FIRST)
    # both slots' first values are read at once, so that the parity's round trip delays nothing
    head = tl.where(parity == 0, tl.load(slots_ptr + first), tl.load(slots_ptr + slot_stride + first))
    table_rows = tl.sum(tl.where(first == 0, head, 0))
    width = tl.maximum(tl.sum(tl.where(first == 1, head, 0)), 1)
    used = HEADER + 3 * num_tokens + 4 * (num_seqs + 1) + table_rows * width
    _place(head, first, used, num_tokens, num_seqs, width, samples_ptr, token_rows_ptr, token_row_stride,
           seq_rows_ptr, seq_row_stride, tables_ptr, table_row_stride)
    slot_ptr = slots_ptr + parity * slot_stride
    for start in range(FIRST, used, BLOCK):
        index = start + tl.arange(0, BLOCK)
        _place(tl.load(slot_ptr + index, mask=index < used), index, used, num_tokens, num_seqs, width, samples_ptr,
               token_rows_ptr, token_row_stride, seq_rows_ptr, seq_row_stride, tables_ptr, table_row_stride)
    tl.store(parity_ptr, 1 - parity)


def stage_inputs(slots, parity, samples, token_rows, seq_rows, block_tables, num_tokens, num_seqs) -> None:
    _stage_kernel[(1,)](slots, slots.stride(0), parity, samples, token_rows, token_rows.stride(0),
                        seq_rows, seq_rows.stride(0), block_tables, block_tables.stride(0), num_tokens, num_seqs,
                        FIRST=STAGE_SLOT_MIN, BLOCK=STAGE_BLOCK, num_warps=4)


@fast_launch
@triton.jit
def _publish_kernel(tokens_ptr, num_tokens, last_ptr, host_ptr, host_stride, parity_ptr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    parity = tl.load(parity_ptr)
    host_ptr += parity * host_stride
    for start in range(0, num_tokens, BLOCK):
        index = start + tl.arange(0, BLOCK)
        tokens = tl.load(tokens_ptr + index, mask=index < num_tokens)
        tl.store(last_ptr + index, tokens, mask=index < num_tokens)
        tl.store(host_ptr + index, tokens, mask=index < num_tokens)
    tl.store(parity_ptr, 1 - parity)


def publish_tokens(tokens, last, host_slots, parity) -> None:
    _publish_kernel[(1,)](tokens, tokens.shape[0], last, host_slots, host_slots.stride(0), parity,
                          BLOCK=PUBLISH_BLOCK, num_warps=4, **dependent_launch(tokens.get_device()))
