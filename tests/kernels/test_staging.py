"""stage_inputs and publish_tokens: copies, so every case compares to the bit. A step in the
slot layout (staged_values) must land in the graph's inputs, deferred input ids read from
the samples, both slots in turn as the parity flips, and nothing else written."""
import random

import pytest
import torch
from kernel_testing import require_triton

from nanovllm import kernels
from nanovllm.kernels import reference
from nanovllm.utils.timing import capture

SENTINEL = -777
PLACES = [
    pytest.param("reference", marks=[], id="reference"),
    pytest.param("cpu", marks=pytest.mark.triton_interpret, id="interpreter"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


def _step(rng: random.Random, num_tokens: int, num_seqs: int, table_rows: int, width: int, num_samples: int):
    ids = [rng.randrange(1000) if rng.random() < 0.5 else -1 - rng.randrange(num_samples) for _ in range(num_tokens)]
    token_rows = [ids, [rng.randrange(1 << 20) for _ in range(num_tokens)],
                  [rng.randrange(-1, 1 << 30) for _ in range(num_tokens)]]
    seq_rows = [[rng.randrange(-(1 << 31), 1 << 31) for _ in range(num_seqs + 1)] for _ in range(4)]
    tables = [[rng.randrange(-1, 1 << 20) for _ in range(width)] for _ in range(table_rows)]
    return token_rows, seq_rows, tables


def _inputs(device: str, num_tokens: int, num_seqs: int, max_width: int):
    """Graph inputs as the model runner lays them out: rows of wider buffers, sentinel-filled."""
    token_rows = torch.full((3, num_tokens + 5), SENTINEL, dtype=torch.long, device=device)
    seq_rows = torch.full((4, num_seqs + 4), SENTINEL, dtype=torch.int32, device=device)
    tables = torch.full((num_seqs + 2, max_width + 3), SENTINEL, dtype=torch.int32, device=device)
    return token_rows, seq_rows, tables


def _expected(inputs, step, samples: list[int]):
    token_rows, seq_rows, tables = (t.clone().cpu() for t in inputs)
    staged_tokens, staged_seqs, staged_tables = step
    ids = [samples[-1 - i] if i < 0 else i for i in staged_tokens[0]]
    for row, values in enumerate([ids, *staged_tokens[1:]]):
        token_rows[row, :len(values)] = torch.tensor(values)
    for row, values in enumerate(staged_seqs):
        seq_rows[row, :len(values)] = torch.tensor(values, dtype=torch.int32)
    for row, values in enumerate(staged_tables):
        tables[row, :len(values)] = torch.tensor(values, dtype=torch.int32)
    return token_rows, seq_rows, tables


def _stage(place: str, *args) -> None:
    (reference.stage_inputs if place == "reference" else kernels.stage_inputs)(*args)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("num_tokens,num_seqs,table_rows,width", [
    (1, 1, 1, 3),  # one decode sequence: all of it in the first values read
    (16, 16, 13, 9),  # a decode batch of 13 in a graph of 16
    (300, 2, 1, 40),  # a prefill: the token rows reach past the first values
    (40, 40, 40, 130),  # two loop steps past the first values
])
def test_stages_a_step_from_either_slot(place, num_tokens, num_seqs, table_rows, width):
    device = "cpu" if place == "reference" else place
    if place != "reference":
        require_triton(device)
    rng = random.Random(num_tokens * 1000 + width)
    samples = [rng.randrange(1 << 40) for _ in range(7)]
    inputs = _inputs(device, num_tokens, num_seqs, width)
    steps = [_step(rng, num_tokens, num_seqs, table_rows, width, len(samples)) for _ in range(3)]
    values = [kernels.staged_values(*step) for step in steps]
    needed = max(len(values[0]), kernels.STAGE_SLOT_MIN)
    assert kernels.staged_length(num_tokens, num_seqs, table_rows * width) == needed
    slots = torch.full((2, max(kernels.STAGE_SLOT_MIN, max(map(len, values)) + 11)), SENTINEL, dtype=torch.int32,
                       pin_memory=device == "cuda")
    parity = torch.zeros(1, dtype=torch.int32, device=device)
    sample_tensor = torch.tensor(samples, device=device)
    for i, (step, step_values) in enumerate(zip(steps, values)):  # slots 0, 1, 0
        slots[i % 2, :len(step_values)] = torch.tensor(step_values, dtype=torch.int32)
        slots[1 - i % 2].random_(-1000, 1000)  # the other slot's contents must not matter
        expected = _expected(inputs, step, samples)
        _stage(place, slots, parity, sample_tensor, *inputs, num_tokens, num_seqs)
        for got, want in zip(inputs, expected):
            assert torch.equal(got.cpu(), want)
        assert parity.item() == (i + 1) % 2


@pytest.mark.gpu
def test_a_captured_graph_stages_what_the_host_wrote_before_each_replay():
    """The pinned slots are read at replay, not at capture: the host writes a slot, replays,
    and the graph's inputs are that step's."""
    rng = random.Random(5)
    num_tokens, num_seqs, width = 4, 4, 6
    inputs = _inputs("cuda", num_tokens, num_seqs, width)
    slots = torch.zeros(2, kernels.STAGE_SLOT_MIN, dtype=torch.int32, pin_memory=True)
    parity = torch.zeros(1, dtype=torch.int32, device="cuda")
    samples = [11, 22, 33]
    sample_tensor = torch.tensor(samples, device="cuda")
    slots[:, :2] = torch.tensor([0, 1], dtype=torch.int32)  # an empty step for the warm-up and capture
    graph, _ = capture(lambda: kernels.stage_inputs(slots, parity, sample_tensor, *inputs, num_tokens, num_seqs))
    torch.cuda.synchronize()
    parity.zero_()
    for i in range(4):
        step = _step(rng, num_tokens, num_seqs, num_seqs, width, len(samples))
        values = kernels.staged_values(*step)
        slots[i % 2, :len(values)] = torch.tensor(values, dtype=torch.int32)
        expected = _expected(inputs, step, samples)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(inputs, expected):
            assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("n", [1, 5, 1500])  # 1500: more than one loop step of the kernel
def test_publishes_to_the_device_and_each_host_row_in_turn(place, n):
    device = "cpu" if place == "reference" else place
    if place != "reference":
        require_triton(device)
    last = torch.full((n + 3,), SENTINEL, dtype=torch.long, device=device)
    host = torch.full((2, n + 2), SENTINEL, dtype=torch.long, pin_memory=device == "cuda")
    parity = torch.zeros(1, dtype=torch.int32, device=device)
    publish = reference.publish_tokens if place == "reference" else kernels.publish_tokens
    rows = []
    for i in range(3):  # rows 0, 1, 0
        tokens = torch.randint(0, 1 << 40, (n,), device=device)
        publish(tokens, last, host, parity)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(last[:n], tokens) and (last[n:] == SENTINEL).all()
        assert torch.equal(host[i % 2, :n], tokens.cpu()) and (host[:, n:] == SENTINEL).all()
        rows.append(tokens.cpu())
        if i:
            assert torch.equal(host[1 - i % 2, :n], rows[i - 1])
        assert parity.item() == (i + 1) % 2


def test_bad_slots_and_rows_name_the_argument():
    slots, parity = torch.zeros(2, kernels.STAGE_SLOT_MIN, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    samples = torch.zeros(4, dtype=torch.long)
    inputs = _inputs("cpu", 4, 4, 8)
    with pytest.raises(ValueError, match="^slots"):
        kernels.stage_inputs(slots[:, :100], parity, samples, *inputs, 4, 4)
    with pytest.raises(ValueError, match="^token_rows"):
        kernels.stage_inputs(slots, parity, samples, *inputs, 40, 4)
    with pytest.raises(ValueError, match="^seq_rows"):
        kernels.stage_inputs(slots, parity, samples, *inputs, 4, 40)
    with pytest.raises(ValueError, match="^host_slots"):
        kernels.publish_tokens(samples, samples, torch.zeros(2, 3, dtype=torch.long), parity)
    with pytest.raises(ValueError, match="^tokens"):
        kernels.publish_tokens(samples.int(), samples, torch.zeros(2, 8, dtype=torch.long), parity)
