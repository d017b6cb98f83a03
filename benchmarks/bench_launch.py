"""Host time of one eager call of each public kernel function at decode size (one row,
Qwen3-0.6B widths), three ways: through the launch layer's direct path (nanovllm/kernels/
launch.py), through Triton's own `kernel[grid]` path (launch.enabled = False; the wrappers
are the same), and as the eager PyTorch reference (nanovllm/kernels/reference.py). Each
figure is the wall clock of `--calls` back-to-back calls between two synchronisations,
divided by the calls: at these sizes the GPU work is a few microseconds, shorter than the
host's, so the wall clock is the host's time. Medians over `--repeats`, the three variants
interleaved. Also times norm._launch alone (the launch without the public wrapper), and
checks that both launch paths give bitwise-equal outputs at several row counts, with
aligned tensors and with every tensor one element off its buffer's start (a different
specialization). The sample reference synchronises (nonzero, tolist).

From the repository root, on a GPU (about a minute):

    python -m benchmarks.bench_launch --out out/bench_launch

Without one, a smoke run of the script's logic through Triton's interpreter:

    TRITON_INTERPRET=1 python -m benchmarks.bench_launch --device cpu --calls 2 --repeats 1 --out /tmp/bench_launch"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from nanovllm import kernels
from nanovllm.kernels import launch, norm, reference

# Qwen3-0.6B
HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 3072, 16, 8, 128, 151936
EPS = 1e-6
BLOCK_SIZE = 16


def build(rows: int, offset: int, device: str, dtype: torch.dtype) -> dict:
    """op -> (fused, eager): functions of no argument returning a tuple of outputs, over inputs
    that are the same for the same arguments, each starting `offset` elements into its buffer."""
    torch.manual_seed(0)

    def randn(*shape, dtype=dtype):
        numel = 1
        for size in shape:
            numel *= size
        return torch.randn(numel + offset, dtype=dtype, device=device)[offset:].view(shape)

    gated, x, residual = randn(rows, 2 * INTERMEDIATE), randn(rows, HIDDEN), randn(rows, HIDDEN)
    weight, bias, head_weight = randn(HIDDEN), randn(HIDDEN), randn(HEAD_DIM)
    qkv = randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).view(rows, -1, HEAD_DIM)
    q, k, v = qkv.split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    positions = torch.arange(rows, device=device)
    cos_sin = randn(4096, HEAD_DIM, dtype=torch.float32)
    k_cache, v_cache = randn(rows + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM), randn(rows + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    slots = torch.arange(rows, device=device) * BLOCK_SIZE + 3
    logits, seeds = randn(rows, VOCAB), torch.arange(rows, device=device)
    temperatures = torch.linspace(1, 0, rows, device=device)  # one row: sampled, not greedy

    def stored(store):
        return lambda: (store(k, v, k_cache, v_cache, slots), k_cache, v_cache)[1:]

    return {
        "silu_and_mul": (lambda: (kernels.silu_and_mul(gated),), lambda: (reference.silu_and_mul(gated),)),
        "gelu_and_mul": (lambda: (kernels.gelu_and_mul(gated),), lambda: (reference.gelu_and_mul(gated),)),
        "fused_add_gelu": (lambda: (kernels.fused_add_gelu(x, bias),), lambda: (reference.fused_add_gelu(x, bias),)),
        "element_wise_mul_add": (lambda: (kernels.element_wise_mul_add(x, residual, bias.expand_as(x)),),
                                 lambda: (reference.element_wise_mul_add(x, residual, bias.expand_as(x)),)),
        "rms_norm": (lambda: (kernels.rms_norm(x, weight, EPS),), lambda: (reference.rms_norm(x, weight, EPS),)),
        "rms_norm [T,H,D] q view": (lambda: (kernels.rms_norm(q, head_weight, EPS),),
                                    lambda: (reference.rms_norm(q, head_weight, EPS),)),
        "fused_add_rms_norm": (lambda: kernels.fused_add_rms_norm(x, residual, weight, EPS),
                               lambda: reference.fused_add_rms_norm(x, residual, weight, EPS)),
        "apply_rotary_emb": (lambda: kernels.apply_rotary_emb(positions, q, k, cos_sin),
                             lambda: reference.apply_rotary_emb(positions, q, k, cos_sin)),
        "store_kvcache": (stored(kernels.store_kvcache), stored(reference.store_kvcache)),
        "sample": (lambda: kernels.sample(logits, temperatures, seeds)[:1],
                   lambda: reference.sample(logits, temperatures, seeds)[:1]),
    }


def launch_only(device: str, dtype: torch.dtype):
    """norm._launch on prepared arguments: the launch without the public function around it."""
    x = torch.randn(1, HIDDEN, dtype=dtype, device=device)
    weight, out, layout = torch.randn(HIDDEN, dtype=dtype, device=device), torch.empty_like(x), norm._row_layout(x)
    return lambda: norm._launch(layout, layout, out, weight, EPS, has_residual=False)


def host_us(variants: dict, calls: int, repeats: int, sync) -> dict:
    """variant -> median microseconds a call; `variants`: name -> (launch.enabled, fn)."""
    for fast, fn in variants.values():
        launch.enabled = fast
        for _ in range(max(3, calls // 100)):  # compilation, both launch caches, the allocator's pools
            fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fast, fn) in variants.items():
            launch.enabled = fast
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    launch.enabled = True
    return {name: statistics.median(values) for name, values in times.items()}


def equal_outputs(op: str, rows: int, offset: int, device: str, dtype: torch.dtype) -> bool:
    """Triton's path against the direct one: fresh, identical inputs for each call, since
    some ops write theirs; the direct path is taken from a specialization's second call."""
    outputs = []
    for fast in (False, True, True):
        launch.enabled = fast
        outputs.append(build(rows, offset, device, dtype)[op][0]())
    launch.enabled = True
    return all(torch.equal(a, b) for out in outputs[1:] for a, b in zip(outputs[0], out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check-rows", type=int, nargs="+", default=[1, 7, 64])
    args = parser.parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    if kernels.backend_for(device) != "triton":
        sys.exit(f"the kernels would not run on Triton for {device}: see NANOVLLM_KERNEL_BACKEND / TRITON_INTERPRET")
    if launch._observed():
        print("warning: a launch hook, debug mode or instrumentation is set; every launch takes Triton's path")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    rows = []
    for op, (fused, eager) in build(1, 0, device, dtype).items():
        us = host_us({"direct": (True, fused), "triton": (False, fused), "eager": (True, eager)}, args.calls,
                     args.repeats, sync)
        rows.append({"op": op, **{f"{name}_us": round(value, 2) for name, value in us.items()},
                     "triton_over_direct": round(us["triton"] / us["direct"], 2),
                     "eager_over_direct": round(us["eager"] / us["direct"], 2)})
    launch_us = host_us({"direct": (True, launch_only(device, dtype)), "triton": (False, launch_only(device, dtype))},
                        args.calls, args.repeats, sync)
    checks = [{"op": op, "rows": n, "offset": offset, "equal": equal_outputs(op, n, offset, device, dtype)}
              for n in args.check_rows for offset in (0, 1) for op in build(n, offset, device, dtype)]

    print(f"host us per call, one row, {args.dtype}, {args.calls} calls x {args.repeats} repeats (median)")
    print(f"{'op':26s} {'direct':>8s} {'triton':>8s} {'eager':>8s} {'triton/direct':>14s} {'eager/direct':>13s}")
    for row in rows:
        print(f"{row['op']:26s} {row['direct_us']:8.2f} {row['triton_us']:8.2f} {row['eager_us']:8.2f} "
              f"{row['triton_over_direct']:14.2f} {row['eager_over_direct']:13.2f}")
    print(f"{'norm._launch alone':26s} {launch_us['direct']:8.2f} {launch_us['triton']:8.2f}")
    mismatches = [check for check in checks if not check["equal"]]
    print(f"bitwise equality, direct vs Triton's path: {len(checks) - len(mismatches)}/{len(checks)} equal"
          + "".join(f"\n  MISMATCH {m['op']} rows={m['rows']} offset={m['offset']}" for m in mismatches))

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or device,
        "cpu": platform.processor(), "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "dtype": args.dtype, "calls": args.calls, "repeats": args.repeats,
        "fast_path_active": isinstance(norm._rms_norm_kernel, launch.FastLauncher) and not launch._observed(),
        "ops": rows, "norm_launch_only_us": {k: round(v, 2) for k, v in launch_us.items()}, "equality": checks,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'results.json'}")
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
