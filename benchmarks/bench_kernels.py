"""Checks and measures every custom kernel; `python test_custom_kernels.py` runs this.

    python -m benchmarks.bench_kernels [--out DIR] [--quick]

1. Correctness of both backends against float64 over the grid of benchmarks/kernel_cases.py.
2. On a GPU, speed in bf16 of the Triton kernel, eager PyTorch and torch.compile of the same
   expression: median ms (nanovllm.utils.timing.benchmark_kernel), the best of three
   interleaved rounds, GB/s of the bytes that must move, and that as a share of the device's
   copy rate measured in this run (nanovllm.utils.timing.device_copy_gbs).
3. Peak memory of each path; 4. kernels a call launches (torch.profiler); 5. the
   Qwen3-0.6B-shaped CustomGatedMLP, fused against eager.

On the CPU only correctness runs: the Triton kernels through Triton's interpreter when
TRITON_INTERPRET=1 is set, the references alone otherwise. Results go to DIR (default
./kernel_results): results.json (every case), summary.json (the correctness grid as one row
per op, dtype and backend: the form kept under benchmarks/results/), results.md and
profiles.txt. Exits 1 on any mismatch."""
import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernel_cases import (OPS, TOLERANCE, Case, correctness_grid, correctness_summary, relative_error,
                                     run_correctness)
from nanovllm.kernels import backend_for
from nanovllm.utils.timing import benchmark_kernel, clone_arguments, device_copy_gbs


def peak_mib(fn: Callable, args: list) -> float:
    """Peak memory one call allocates beyond what is already there."""
    args, _ = clone_arguments(args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def count_kernels(fn: Callable, args: list) -> tuple[int, str]:
    from torch.profiler import ProfilerActivity, profile
    args, _ = clone_arguments(args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), prof.key_averages().table(sort_by="device_time_total", row_limit=12)


def _compiled(fn: Callable, compile_seconds: list) -> Callable:
    """torch.compile(fn) for fixed shapes; the first call's compile time is added up."""
    compiled = torch.compile(fn, dynamic=False)
    state = {"first": True}

    def call(*args):
        if not state["first"]:
            return compiled(*args)
        started = time.perf_counter()
        out = compiled(*args)
        torch.cuda.synchronize()
        compile_seconds.append(time.perf_counter() - started)
        state["first"] = False
        return out
    return call


def raise_recompile_limit() -> None:
    """Every timed shape is compiled on its own (dynamic=False, the fastest code inductor makes);
    past the default limit of 8 a function would silently run eager."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)


# Paths are timed in turn, ROUNDS times, and each keeps its best round: the GPU's state drifts
# between runs by up to 50% on 2 us calls (H100), and interleaving gives every path the same.
ROUNDS = 3


def time_paths(case: Case, paths: dict, copy_gbs: float) -> dict:
    iters = 20 if case.bytes_moved > 256 << 20 else 50
    rounds = {name: [] for name in paths}
    for _ in range(ROUNDS):
        for name, fn in paths.items():
            rounds[name].append(benchmark_kernel(fn, *case.args, warmup=5, iters=iters))
    ms = {name: min(times) for name, times in rounds.items()}
    gbs = case.bytes_moved / ms["triton"] / 1e6
    return dict(bytes_moved=case.bytes_moved, ms=ms, rounds_ms=rounds, triton_gbs=gbs, pct_of_copy=100 * gbs / copy_gbs,
                speedup_vs_eager=ms["eager"] / ms["triton"], speedup_vs_compile=ms["compile"] / ms["triton"],
                peak_mib={name: peak_mib(fn, case.args) for name, fn in paths.items()})


def run_speed(copy_gbs: float, quick: bool):
    raise_recompile_limit()
    rows_grid = (1, 64, 4096, 32768) if quick else (1, 64, 256, 4096, 32768)
    records, profiles, compile_seconds = [], [], []
    for op in OPS:
        for width, strided in op.bench:
            for rows in rows_grid:
                torch.manual_seed(0)
                case = op.make(rows, width, torch.bfloat16, torch.device("cuda"), strided)
                paths = {"triton": op.fused, "eager": op.eager, "compile": _compiled(op.eager, compile_seconds)}
                record = dict(op=op.name, rows=rows, width=width, strided=strided, dtype="bfloat16",
                              **time_paths(case, paths, copy_gbs))
                if rows == 4096:  # kernels a call launches do not depend on the row count
                    record["kernels"] = {}
                    for name, fn in paths.items():
                        record["kernels"][name], table = count_kernels(fn, case.args)
                        profiles.append(f"### {op.name} [{name}] {rows}x{width}{' strided' if strided else ''} "
                                        f"bf16: {record['kernels'][name]} kernel(s)\n{table}")
                records.append(record)
                ms = record["ms"]
                print(f"  {op.name:20s} {rows:5d}x{width:<4d}{'s' if strided else ' '} triton {ms['triton']:.4f} ms"
                      f"  eager {ms['eager']:.4f}  compile {ms['compile']:.4f}  {record['triton_gbs']:6.0f} GB/s"
                      f" ({record['pct_of_copy']:3.0f}% of copy)  x{record['speedup_vs_eager']:.2f} eager"
                      f"  x{record['speedup_vs_compile']:.2f} compile"
                      + (f"  kernels {'/'.join(str(v) for v in record['kernels'].values())}" if "kernels" in record else ""))
    print(f"torch.compile: {len(compile_seconds)} compilations, {sum(compile_seconds):.1f}s in all")
    return records, profiles, sum(compile_seconds)


def run_mlp():
    """Qwen3-0.6B's MLP (hidden 1024, intermediate 3072) in bf16: fused silu_and_mul against
    eager silu(gate) * up, both checked against a float64 run of the same weights."""
    from nanovllm.layers.custom_mlp import CustomGatedMLP
    torch.manual_seed(0)
    fused = CustomGatedMLP(1024, 3072).to(device="cuda", dtype=torch.bfloat16)
    for p in fused.parameters():
        torch.nn.init.normal_(p, std=1024 ** -0.5)
    plain = CustomGatedMLP(1024, 3072, use_custom_kernels=False).to(device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    exact = CustomGatedMLP(1024, 3072, use_custom_kernels=False).to(device="cuda", dtype=torch.float64)
    exact.load_state_dict(fused.state_dict())
    records = []
    with torch.inference_mode():
        for tokens in (1, 64, 4096):
            x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
            ref = exact(x.double())
            record = dict(tokens=tokens, rel_error={n: relative_error(m(x), ref) for n, m in
                                                    (("fused", fused), ("eager", plain))},
                          ms={n: benchmark_kernel(m, x, iters=50) for n, m in (("fused", fused), ("eager", plain))},
                          peak_mib={n: peak_mib(m, [x]) for n, m in (("fused", fused), ("eager", plain))})
            record["speedup"] = record["ms"]["eager"] / record["ms"]["fused"]
            record["ok"] = record["rel_error"]["fused"] <= TOLERANCE[torch.bfloat16]
            records.append(record)
            print(f"  MLP tokens={tokens:5d} fused {record['ms']['fused']:.4f} ms  eager {record['ms']['eager']:.4f} ms"
                  f"  x{record['speedup']:.2f}  rel error fused {record['rel_error']['fused']:.2e}"
                  f" eager {record['rel_error']['eager']:.2e}  peak MiB {record['peak_mib']}")
    return records


def _markdown(results: dict) -> str:
    """results.md, from the summary (correctness rows grouped by op, dtype and backend)."""
    lines = [f"# Kernel results\n\n{results['environment']}\n"]
    lines.append("## Correctness (worst relative error against float64)\n")
    lines.append("| op | dtype | backend | cases | worst rel. error | tolerance | status |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in results["correctness"]:
        lines.append(f"| {r['op']} | {r['dtype']} | {r['backend']} | {r['cases']} | {r['worst_rel_error']:.2e} | "
                     f"{r['tolerance']:.0e} | {'FAIL' if r['mismatches'] else 'ok'} |")
    if results.get("speed"):
        lines.append(f"\n## Speed, bf16 (copy bandwidth {results['copy_gbs']:.0f} GB/s)\n")
        lines.append("| op | shape | triton ms | eager ms | compile ms | triton GB/s | % of copy | x eager "
                     "| x compile | peak MiB triton/eager/compile | kernels triton/eager/compile |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["speed"]:
            ms, pk = r["ms"], r["peak_mib"]
            kernels = "/".join(str(v) for v in r["kernels"].values()) if "kernels" in r else ""
            lines.append(f"| {r['op']} | {r['rows']}x{r['width']}{' strided' if r['strided'] else ''} | "
                         f"{ms['triton']:.4f} | {ms['eager']:.4f} | {ms['compile']:.4f} | {r['triton_gbs']:.0f} | "
                         f"{r['pct_of_copy']:.0f}% | {r['speedup_vs_eager']:.2f} | {r['speedup_vs_compile']:.2f} | "
                         f"{pk['triton']:.1f}/{pk['eager']:.1f}/{pk['compile']:.1f} | {kernels} |")
        lines.append("\n## CustomGatedMLP 1024 -> 3072, bf16\n")
        lines.append("| tokens | fused ms | eager ms | speed-up | rel. error fused / eager | peak MiB fused / eager |")
        lines.append("|---|---|---|---|---|---|")
        for r in results["mlp"]:
            lines.append(f"| {r['tokens']} | {r['ms']['fused']:.4f} | {r['ms']['eager']:.4f} | {r['speedup']:.2f} | "
                         f"{r['rel_error']['fused']:.2e} / {r['rel_error']['eager']:.2e} | "
                         f"{r['peak_mib']['fused']:.1f} / {r['peak_mib']['eager']:.1f} |")
    else:
        lines.append("\nSpeed, memory and kernel counts need a CUDA GPU: not measured in this run.")
    return "\n".join(lines) + "\n"


def _environment(device: torch.device, backends: dict) -> str:
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return (f"device {name}{interp}; torch {torch.__version__}; triton {triton_version}; "
            f"backends checked: {', '.join(backends)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kernel_results", help="folder for results.json, results.md, profiles.txt")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = {"torch": lambda op: op.ref}
    if backend_for(device) == "triton":
        backends["triton"] = lambda op: op.fused
    else:
        print(f"Triton backend: not run on {device} (needs a CUDA GPU or TRITON_INTERPRET=1); "
              "checking the PyTorch references only")
    environment = _environment(device, backends)
    print(environment)
    correctness, failures = run_correctness(device, correctness_grid(device, args.quick), backends)
    results = dict(environment=environment, correctness=correctness, failures=failures)
    profiles = []
    if device.type == "cuda":
        results["copy_gbs"] = device_copy_gbs()
        print(f"device copy rate: {results['copy_gbs']:.0f} GB/s (1 GiB, read + write)")
        results["speed"], profiles, results["compile_seconds"] = run_speed(results["copy_gbs"], args.quick)
        results["mlp"] = run_mlp()
        failures += sum(not r["ok"] for r in results["mlp"])
    else:
        print("speed, memory and kernel counts need a CUDA GPU: skipped")
    results["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(results, correctness=correctness_summary(correctness))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(_markdown(summary))
    if profiles:
        (out / "profiles.txt").write_text("\n\n".join(profiles))
    print(f"{'FAILED' if failures else 'all correct'}: {failures} mismatch(es); {results['seconds']:.0f}s; "
          f"results in {out}/")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

