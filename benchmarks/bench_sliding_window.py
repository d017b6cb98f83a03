"""Decode time of nanovllm's paged attention with a sliding window, at Mistral-7B's attention
shape (32 query heads, 8 kv heads, head dim 128, bf16). A query at the end of a long context
with a window reads only the window's cache blocks, so its step should take about as long as
a step over a context as short as the window, and far less than one over the whole context:

    window   W keys over C keys of context   (the case)
    short    W keys of context, no window    (what it should cost)
    full     C keys of context, no window    (what it would cost without the skip)

Block tables are as wide as the long context in every case, as in the engine's decode CUDA
graphs. Each case is checked against the PyTorch reference (its first two sequences) before
it is timed; times are medians of CUDA-graph replays (nanovllm.kernels.benchmark_kernel).
Writes bench_sliding_window.json into --out. From the repository root, on a GPU:

    python -m benchmarks.bench_sliding_window --out out/bench_sliding_window

A smoke run of the logic without a GPU (Triton's interpreter, tiny sizes):

    TRITON_INTERPRET=1 python -m benchmarks.bench_sliding_window --device cpu --dtype float32 \\
        --context 512 --window 64 --batch 1 2 --iters 2 --out /tmp/bench_sliding_window"""
import argparse
import json
import platform
from pathlib import Path

import torch

from nanovllm import kernels
from nanovllm.kernels import reference

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Mistral-7B
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # relative error against the fp32 reference


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768, help="keys before the decoded token")
    parser.add_argument("--window", type=int, default=4096, help="sliding window (Mistral-7B-v0.1's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="sequences per decode step")
    parser.add_argument("--block-size", type=int, default=128, help="KV cache block size (the engine default)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=100, help="timed calls per case")
    parser.add_argument("--out", required=True, type=Path, help="folder for bench_sliding_window.json")
    return parser.parse_args()


def decode_step(batch: int, seq_len: int, table_tokens: int, block_size: int, dtype, device, seed: int = 0) -> dict:
    """Arguments of paged_attention for `batch` sequences of seq_len keys decoding one token,
    their blocks scattered over the cache, their tables `table_tokens` wide."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-table_tokens // block_size)
    cache_shape = (batch * width, block_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
    block_tables = torch.randperm(batch * width, generator=gen, device=device).view(batch, width).int()
    return dict(q=torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype),
                k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                cu_seqlens_q=torch.arange(batch + 1, device=device, dtype=torch.int32),
                seq_lens=torch.full((batch,), seq_len, device=device, dtype=torch.int32),
                max_seqlen_q=1, scale=HEAD_DIM ** -0.5)


def check(step: dict, window: int | None, dtype) -> float:
    out = kernels.paged_attention(**step, sliding_window=window)[:2].float()
    first = {k: v[:2] if k in ("q", "block_tables", "seq_lens") else v for k, v in step.items()}
    first["cu_seqlens_q"] = step["cu_seqlens_q"][:3]
    expected = reference.paged_attention(**{**first, "q": first["q"].float(), "k_cache": step["k_cache"].float(),
                                            "v_cache": step["v_cache"].float()}, sliding_window=window)
    error = ((out - expected).norm() / expected.norm()).item()
    if error > TOLERANCE[dtype]:
        raise SystemExit(f"relative error {error:.2e} over {TOLERANCE[dtype]:.0e}")
    return error


def main():
    args = parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    cases = {"window": (args.context, args.window), "short": (args.window, None), "full": (args.context, None)}
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "dtype": args.dtype, "heads": [Q_HEADS, KV_HEADS], "head_dim": HEAD_DIM, "context": args.context,
               "window": args.window, "block_size": args.block_size, "torch": torch.__version__, "runs": []}
    for batch in args.batch:
        row = {"batch": batch}
        for name, (seq_len, window) in cases.items():
            step = decode_step(batch, seq_len, args.context, args.block_size, dtype, device)
            row[f"{name}_rel_err"] = check(step, window, dtype)
            ms = kernels.benchmark_kernel(kernels.paged_attention, warmup=max(1, args.iters // 5), iters=args.iters,
                                          **step, sliding_window=window)
            row[f"{name}_us"] = round(1e3 * ms, 2)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["window_over_short"] = round(row["window_us"] / row["short_us"], 3)
        row["full_over_window"] = round(row["full_us"] / row["window_us"], 2)
        print(f"batch {batch:3d}: window {row['window_us']:9.2f} us  short {row['short_us']:9.2f} us  "
              f"full {row['full_us']:9.2f} us  window/short {row['window_over_short']:.3f}  "
              f"full/window {row['full_over_window']:.2f}", flush=True)
        results["runs"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sliding_window.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
