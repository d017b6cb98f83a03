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


def test_shared_weights_change_only_where_the_layers_read_them():
    """The two decoder-layer graphs differ in the weights' addresses alone: layers that share
    layer 0's tensors compute what layers holding copies of them compute."""
    from benchmarks.bench_chain import decode_inputs, decoder_layers, layer_weights
    shape = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 96, "layers": 3}
    torch.manual_seed(0)
    shared = layer_weights(shape, True, "cpu", torch.float32)
    assert all(layer is shared[0] for layer in shared)
    copies = [{name: t.clone() for name, t in shared[0].items()} for _ in shared]
    inputs = decode_inputs(shape, 40, 16, "cpu", torch.float32)
    same_inputs = {**inputs, "hidden": inputs["hidden"].clone(),
                   "caches": [(k.clone(), v.clone()) for k, v in inputs["caches"]]}
    out = decoder_layers(shape, shared, inputs)
    assert torch.equal(out, decoder_layers(shape, copies, same_inputs))
    assert out.shape == (1, shape["hidden"]) and torch.isfinite(out).all()
