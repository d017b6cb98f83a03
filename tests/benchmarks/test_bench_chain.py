"""benchmarks/bench_chain.py (interpreter): each link of the chain reads the whole vector before
it and writes the next one; the decoder-layer graph computes a decode step, and its shared
variant reads layer 0's weights in every layer."""
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


SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 96, "layers": 2}


def reference_layers(weights, inputs, context: int) -> torch.Tensor:
    """The decoder layers of one decode step in float64 over the cached keys gathered whole."""
    heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    eps = 1e-6
    cos, sin = inputs["cos_sin"][context - 1].double().chunk(2)

    def norm(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def rotate(t):
        first, second = t.chunk(2, -1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)

    x, residual = inputs["hidden"].double(), None
    for w, (k_cache, v_cache) in zip(weights, inputs["caches"]):
        residual = x if residual is None else x + residual
        q, k, v = (norm(residual, w["input_norm"]) @ w["qkv"].double().T).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = rotate(norm(q.view(heads, head_dim), w["q_norm"]))
        k = rotate(norm(k.view(kv_heads, head_dim), w["k_norm"]))
        cached = lambda cache: cache.reshape(-1, kv_heads, head_dim)[:context - 1].double()
        keys = torch.cat([cached(k_cache), k[None]]).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([cached(v_cache), v.view(1, kv_heads, head_dim)]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q, keys) * head_dim ** -0.5
        attention = torch.einsum("ht,thd->hd", scores.softmax(-1), values).reshape(1, -1)
        residual = attention @ w["o"].double().T + residual
        gate, up = (norm(residual, w["post_norm"]) @ w["gate_up"].double().T).chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up) @ w["down"].double().T
    return x


def test_decoder_layers_compute_a_decode_step():
    """The layer graph runs a decoder layer's kernels wired as a decoder layer: its output is a
    plain float64 decode step's (fp32 operands, relative error under 1e-5)."""
    from benchmarks.bench_chain import decode_inputs, decoder_layers, layer_weights
    torch.manual_seed(0)
    context = 40
    weights = layer_weights(SHAPE, False, "cpu", torch.float32)
    for layer in weights:  # the benchmark's norms are ones: distinct ones tell them apart
        for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
            layer[name].uniform_(0.5, 1.5)
    inputs = decode_inputs(SHAPE, context, 16, "cpu", torch.float32)
    expected = reference_layers(weights, inputs, context)
    out = decoder_layers(SHAPE, weights, inputs).double()
    assert ((out - expected).norm() / expected.norm()).item() < 1e-5


def test_shared_weights_are_layer_zeros():
    from benchmarks.bench_chain import layer_weights
    own, shared = (layer_weights(SHAPE, flag, "cpu", torch.float32) for flag in (False, True))
    assert all(layer is shared[0] for layer in shared)
    assert own[1] is not own[0] and not torch.equal(own[1]["qkv"], own[0]["qkv"])
