"""benchmarks/bench_chain.py: each link of the chain reads the whole vector before it and
writes the next one (interpreter)."""
import pytest
import torch

pytestmark = pytest.mark.triton_interpret


@pytest.mark.parametrize("programs", [1, 8, 1024])
def test_each_link_writes_sum_mod_7_plus_index(programs):
    from benchmarks.bench_chain import WIDTH, chain
    buffers = [torch.zeros(WIDTH), torch.full((WIDTH,), -1.0)]
    expected = buffers[0].clone()
    for _ in range(3):
        expected = torch.remainder(expected.double().sum(), 7) + torch.arange(WIDTH, dtype=torch.float64)
    chain(buffers, 3, programs, pdl=False)
    assert torch.equal(buffers[1].double(), expected)
