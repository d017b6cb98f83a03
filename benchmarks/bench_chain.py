"""The cost of a kernel boundary in a chain of dependent kernels, as a batch-1 decode step
runs them: each kernel's programs read the whole vector the kernel before wrote (as a GEMV
reads its input row), add it up, and write their share of the next vector. No weights, no
arithmetic to speak of: what is left is the launch, the wait for the previous kernel to end,
one round trip for the input, the store and the end. Times a CUDA graph of `--links` such
kernels, with and without programmatic dependent launch (launch.py), for several grid sizes,
and divides by the links. A decode step's dependent kernels cost at least this much each
(docs/performance.md#decode-latency).

Then the same for the kernels of a decoder layer at batch 1, as the engine runs them at one
sequence (norm_linear for qkv, leaving room for the attention, qk_norm_rope_attention, the o
projection, norm_linear for gate_up with its activation, the down projection), Qwen3-0.6B's shape, 28 layers in
one graph, one sequence of 1,024 keys in blocks of 128. Once with every layer's own weights,
once with all layers reading layer 0's, which then stay in the L2 cache: the difference is
what streaming the weights from memory adds to the chain, and so the most that reading them
ahead could save.

    python -m benchmarks.bench_chain --out DIR
"""
import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanovllm import kernels
from nanovllm.kernels.launch import await_previous_kernel, dependent_launch
from nanovllm.layers.rotary_embedding import build_cos_sin_cache
from nanovllm.utils import timing

WIDTH = 1024  # Qwen3-0.6B's hidden size: the vector each link reads
QWEN3_0_6B = {"hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072, "layers": 28}
EPS = 1e-6


@triton.jit
def _link_kernel(src_ptr, dst_ptr, WIDTH: tl.constexpr, SHARE: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    total = tl.sum(tl.load(src_ptr + tl.arange(0, WIDTH)).to(tl.float32), axis=0)
    offs = tl.program_id(0) * SHARE + tl.arange(0, SHARE)
    # (total mod 7) + the index keeps every value small and exact in fp32, and makes each
    # output depend on the whole input
    tl.store(dst_ptr + offs, (total - 7.0 * tl.floor(total / 7.0) + offs).to(dst_ptr.dtype.element_ty),
             mask=offs < WIDTH)


def link(src: torch.Tensor, dst: torch.Tensor, programs: int, pdl: bool) -> None:
    """dst[i] = (sum(src) mod 7) + i, src and dst WIDTH long, by about `programs` programs (each
    a power-of-two share of dst)."""
    share = triton.next_power_of_2(triton.cdiv(WIDTH, programs))
    options = dependent_launch(src.get_device()) if pdl else {"PDL": False, "launch_pdl": False}
    _link_kernel[(triton.cdiv(WIDTH, share),)](src, dst, WIDTH=WIDTH, SHARE=share, num_warps=4, **options)


def chain(buffers: list[torch.Tensor], links: int, programs: int, pdl: bool) -> None:
    for i in range(links):
        link(buffers[i % 2], buffers[(i + 1) % 2], programs, pdl)


def time_link_us(links: int, programs: int, pdl: bool, replays: int) -> float:
    buffers = [torch.zeros(WIDTH, device="cuda") for _ in range(2)]
    graph, _ = timing.capture(lambda: chain(buffers, links, programs, pdl))
    return statistics.median(timing.time_events(graph.replay) for _ in range(replays)) * 1e3 / links


def layer_weights(shape: dict, shared: bool, device, dtype=torch.bfloat16) -> list[dict]:
    """Random projections and norm weights of ones for each decoder layer; with `shared`, every
    layer's are layer 0's."""
    hidden, head_dim = shape["hidden"], shape["head_dim"]

    def layer():
        def weight(rows, cols):
            return (torch.randn(rows, cols, device=device) * cols ** -0.5).to(dtype)
        ones = lambda n: torch.ones(n, device=device, dtype=dtype)
        return {"qkv": weight((shape["heads"] + 2 * shape["kv_heads"]) * head_dim, hidden),
                "o": weight(hidden, shape["heads"] * head_dim), "gate_up": weight(2 * shape["intermediate"], hidden),
                "down": weight(hidden, shape["intermediate"]), "input_norm": ones(hidden), "post_norm": ones(hidden),
                "q_norm": ones(head_dim), "k_norm": ones(head_dim)}
    first = layer()
    return [first if shared or i == 0 else layer() for i in range(shape["layers"])]


def decode_inputs(shape: dict, context: int, block_size: int, device, dtype=torch.bfloat16) -> dict:
    """One sequence of `context` keys (the last one this step's) and each layer's KV cache."""
    blocks = triton.cdiv(context, block_size)
    cache_shape = (blocks, block_size, shape["kv_heads"], shape["head_dim"])
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    return {"hidden": torch.randn(1, shape["hidden"], device=device, dtype=dtype),
            "positions": torch.tensor([context - 1], device=device),
            "slot_mapping": torch.tensor([context - 1], device=device),
            "seq_lens": as_int32([context]), "cu_seqlens_q": as_int32([0, 1]),
            "block_tables": torch.arange(blocks, dtype=torch.int32, device=device)[None],
            "cos_sin": build_cos_sin_cache(shape["head_dim"], context, 1e6).to(device),
            "caches": [(torch.randn(cache_shape, device=device, dtype=dtype),
                        torch.randn(cache_shape, device=device, dtype=dtype)) for _ in range(shape["layers"])]}


def decoder_layers(shape: dict, weights: list[dict], inputs: dict) -> torch.Tensor:
    """The layers' batch-1 decode kernels in the engine's order; returns the last down projection."""
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    x, residual = inputs["hidden"], None
    for w, (k_cache, v_cache) in zip(weights, inputs["caches"]):
        qkv, residual = kernels.norm_linear(x, residual, w["input_norm"], EPS, w["qkv"], leave_room=True)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        attention = kernels.qk_norm_rope_attention(
            q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim), v.view(1, kv_heads, head_dim),
            inputs["positions"], inputs["cos_sin"], k_cache, v_cache, inputs["slot_mapping"],
            cu_seqlens_q=inputs["cu_seqlens_q"], seq_lens=inputs["seq_lens"], block_tables=inputs["block_tables"],
            max_seqlen_q=1, scale=head_dim ** -0.5, q_weight=w["q_norm"], k_weight=w["k_norm"], eps=EPS)
        o = kernels.linear(attention.view(1, heads * head_dim), w["o"])
        gated, residual = kernels.norm_linear(o, residual, w["post_norm"], EPS, w["gate_up"], activation="silu")
        x = kernels.linear(gated, w["down"])
    return x


def layer_graph(shared: bool, context: int, block_size: int):
    """-> (the decoder layers' CUDA graph, the tensors it reads, kept alive with it)."""
    torch.manual_seed(0)
    weights = layer_weights(QWEN3_0_6B, shared, "cuda")
    inputs = decode_inputs(QWEN3_0_6B, context, block_size, "cuda")
    graph, _ = timing.capture(lambda: decoder_layers(QWEN3_0_6B, weights, inputs))
    return graph, (weights, inputs)


def time_layer_us(graph, replays: int) -> float:
    return statistics.median(timing.time_events(graph.replay) for _ in range(replays)) * 1e3 / QWEN3_0_6B["layers"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--links", type=int, default=200)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--programs", type=int, nargs="+", default=[8, 128, 256, 1024])
    parser.add_argument("--context", type=int, default=1024, help="keys of the decoder layers' sequence")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--layer-rounds", type=int, default=5, help="alternations of the two decoder-layer graphs")
    args = parser.parse_args()
    rows = [{"programs": programs, "pdl": pdl, "us_per_link": time_link_us(args.links, programs, pdl, args.replays)}
            for programs in args.programs for pdl in (True, False)]
    for row in rows:
        print(f"{row['programs']:5d} programs, PDL {'on ' if row['pdl'] else 'off'}: {row['us_per_link']:.2f} us a link")
    graphs = {name: layer_graph(name == "shared", args.context, args.block_size) for name in ("own", "shared")}
    # alternated, so that clock and temperature drift reach both alike
    layer_us = {name: [] for name in graphs}
    for _ in range(args.layer_rounds):
        for name, (graph, _) in graphs.items():
            layer_us[name].append(time_layer_us(graph, args.replays))
    layers = {name: statistics.median(times) for name, times in layer_us.items()}
    print(f"decoder layers, batch 1 at {args.context} keys: {layers['own']:.2f} us a layer with their own weights, "
          f"{layers['shared']:.2f} with layer 0's for all (in L2)")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "links": args.links, "width": WIDTH, "rows": rows,
              "decoder_layers": {"shape": QWEN3_0_6B, "context": args.context, "block_size": args.block_size,
                                 "us_per_layer": layers, "rounds": layer_us}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_chain.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
