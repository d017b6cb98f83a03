"""A decode step's attention over an FP8 (e4m3) KV cache against the same step over bf16: 16
sequences of 32k keys, one layer, shapes from nanovllm/configs (Qwen3-8B: heads of 128,
Llama-3.2-1B: heads of 64). Times, inside CUDA graphs (nanovllm.utils.timing.benchmark_kernel):
the layer's qk_norm_rope_attention (KV write and attention), paged_attention as dispatched, the
Triton kernel unsplit, and for heads of 64 the CUDA C++ decode kernel; each kernel's share of the
KV read floor (the cache bytes read over the device's copy rate, timing.device_copy_gbs). Prints
one JSON object.

    python -m benchmarks.bench_kv_fp8 [--seqs 16] [--keys 32768]"""
import argparse
import json
from pathlib import Path

import torch

from nanovllm import kernels
from nanovllm.kernels import attention, reference
from nanovllm.utils import timing

CONFIGS = Path(__file__).resolve().parent.parent / "nanovllm" / "configs"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.05  # N(0, 1) keys and values stored as values up to about +-100


def _shapes(model: str) -> tuple[int, int, int]:
    config = json.loads((CONFIGS / model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_attention_heads"], config["num_key_value_heads"], head_dim


def _step(model: str, seqs: int, keys: int, block_size: int, kv_dtype: torch.dtype) -> dict:
    """One layer's decode-step operands: caches of seqs * keys slots in permuted blocks."""
    q_heads, kv_heads, head_dim = _shapes(model)
    blocks_per_seq = -(-keys // block_size)
    num_blocks = seqs * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = []
    for scale in (K_SCALE, V_SCALE):
        values = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        caches.append(reference.to_cache(values, scale, kv_dtype) if kv_dtype == FP8 else values)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(seqs, blocks_per_seq)
    qkv = torch.randn(seqs, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = qkv.view(seqs, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=1)
    positions = torch.full((seqs,), keys - 1, device="cuda", dtype=torch.long)
    slots = (tables[:, (keys - 1) // block_size].long() * block_size + (keys - 1) % block_size)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    freqs = torch.outer(torch.arange(keys, device="cuda", dtype=torch.float32), inv_freq)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if kv_dtype == FP8 else {}
    metadata = dict(cu_seqlens_q=torch.arange(seqs + 1, device="cuda", dtype=torch.int32),
                    seq_lens=torch.full((seqs,), keys, device="cuda", dtype=torch.int32), block_tables=tables,
                    max_seqlen_q=1, scale=head_dim ** -0.5)
    return dict(q=q, k=k, v=v, positions=positions, cos_sin=torch.cat((freqs.cos(), freqs.sin()), -1).bfloat16(),
                k_cache=caches[0], v_cache=caches[1], slots=slots, metadata=metadata, scales=scales,
                kv_bytes=2 * seqs * keys * kv_heads * head_dim * caches[0].element_size())


def _time_step(step: dict, copy_gbps: float, with_cuda: bool) -> dict:
    meta, scales = step["metadata"], step["scales"]
    caches = (step["k_cache"], step["v_cache"])
    times = {
        "qk_norm_rope_attention": timing.benchmark_kernel(
            lambda q, k, v: kernels.qk_norm_rope_attention(q, k, v, step["positions"], step["cos_sin"], *caches,
                                                           step["slots"], **meta, **scales),
            step["q"], step["k"], step["v"]),
        "paged_attention": timing.benchmark_kernel(
            lambda q: kernels.paged_attention(q, *caches, **meta, **scales), step["q"]),
        "triton_unsplit": timing.benchmark_kernel(
            lambda q: attention.paged_attention(q, *caches, **meta, **scales, num_splits=1), step["q"]),
    }
    if with_cuda:
        from nanovllm.kernels.cuda import paged_decode
        ext = paged_decode.module()
        assert ext is not None and paged_decode.supports(step["q"], *caches, meta["cu_seqlens_q"], meta["seq_lens"],
                                                         meta["block_tables"])
        times["cuda_decode"] = timing.benchmark_kernel(
            lambda q: paged_decode.paged_decode(ext, q, *caches, meta["cu_seqlens_q"], meta["seq_lens"],
                                                meta["block_tables"], meta["scale"], scales.get("k_scale", 1.0),
                                                scales.get("v_scale", 1.0), True), step["q"])
    floor_ms = step["kv_bytes"] / copy_gbps / 1e6
    return {"kv_bytes": step["kv_bytes"], "floor_ms": floor_ms, "ms": times,
            "of_floor": {name: floor_ms / ms for name, ms in times.items()}}


def _check(step: dict) -> None:
    """The dispatched kernel against the reference on one sequence, before timing."""
    meta = step["metadata"]
    one = dict(meta, cu_seqlens_q=meta["cu_seqlens_q"][:2], seq_lens=meta["seq_lens"][:1],
               block_tables=meta["block_tables"][:1])
    out = kernels.paged_attention(step["q"][:1], step["k_cache"], step["v_cache"], **one, **step["scales"])
    want = reference.paged_attention(step["q"][:1].float(), step["k_cache"], step["v_cache"], **one,
                                     **step["scales"])
    error = ((out.float() - want).norm() / want.norm()).item()
    assert error < 2e-2, f"relative error {error:.3e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    copy_gbps = timing.device_copy_gbs()
    results = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "seqs": args.seqs, "keys": args.keys,
               "block_size": args.block_size, "models": {}}
    for model in ("qwen3-8b", "llama-3.2-1b"):
        with_cuda = _shapes(model)[2] == 64
        runs = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
            step = _step(model, args.seqs, args.keys, args.block_size, dtype)
            _check(step)
            runs[name] = _time_step(step, copy_gbps, with_cuda)
            del step
            torch.cuda.empty_cache()
        runs["fp8_speedup"] = {op: runs["bf16"]["ms"][op] / runs["fp8"]["ms"][op] for op in runs["fp8"]["ms"]}
        results["models"][model] = runs
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
