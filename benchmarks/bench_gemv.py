"""The Triton GEMV (nanovllm.kernels.small_batch_linear) against F.linear (cuBLAS) on the
projections of Qwen3-0.6B and Qwen3-8B (qkv, o, gate_up, down and the LM head, shapes read
from nanovllm/configs) at 1, 2, 4, 8 and 16 rows, bf16. Times are medians of CUDA-graph
replays (nanovllm.kernels.benchmark_kernel: the weights rotate through enough copies to
exceed the L2 cache, so every call reads its weight from HBM); "% copy" is the bytes moved
(weight, x and output) per second as a share of a 1 GiB device-to-device copy's rate
measured in the same run (read + write). Also checks each GEMV result against cuBLAS's.

    python -m benchmarks.bench_gemv --out out/gemv                 # about a minute
    python -m benchmarks.bench_gemv --sweep --out out/gemv_sweep   # + other GEMV tilings

--sweep times other launch settings of the GEMV (feature and K block sizes, programs per SM,
pipeline stages) on the Qwen3-0.6B shapes at --sweep-rows rows."""
import argparse
import itertools
import os

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from benchmarks.bench_latency import CONFIGS, copy_rate_gbs, write_json
from benchmarks.kernel_cases import relative_error
from nanovllm import kernels
from nanovllm.models import model_config_from_dir

MODELS = ("qwen3-0.6b", "qwen3-8b")
ROWS = (1, 2, 4, 8, 16)
SWEEP_TILES = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))


def projections(name: str) -> dict[str, tuple[int, int]]:
    """Projection -> (N, K) of the packaged config `name`."""
    c = model_config_from_dir(os.path.join(CONFIGS, name))
    q = c.num_attention_heads * c.head_dim
    return {"qkv": (q + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def moved_bytes(rows: int, n: int, k: int, element_size: int) -> int:
    return (n * k + rows * k + rows * n) * element_size


def operands(rows: int, n: int, k: int):
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    return x, torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5


def compare(copy_gbs: float) -> list[dict]:
    from nanovllm.kernels import gemv
    records = []
    print(f"{'model':11s} {'proj':8s} {'N':>7s} {'K':>6s} {'rows':>4s} {'gemv us':>8s} {'cuBLAS us':>9s} "
          f"{'speed-up':>8s} {'gemv %copy':>10s} {'cuBLAS %copy':>12s} {'splits':>6s} {'rel err':>8s}")
    for model in MODELS:
        for proj, (n, k) in projections(model).items():
            for rows in ROWS:
                x, weight = operands(rows, n, k)
                error = relative_error(kernels.small_batch_linear(x, weight), F.linear(x, weight))
                gemv_ms = kernels.benchmark_kernel(kernels.small_batch_linear, x, weight)
                cublas_ms = kernels.benchmark_kernel(F.linear, x, weight)
                gb = moved_bytes(rows, n, k, x.element_size()) / 1e9
                record = {"model": model, "proj": proj, "n": n, "k": k, "rows": rows, "gemv_us": gemv_ms * 1e3,
                          "cublas_us": cublas_ms * 1e3, "speedup": cublas_ms / gemv_ms,
                          "gemv_pct_copy": 100 * gb / gemv_ms * 1e3 / copy_gbs,
                          "cublas_pct_copy": 100 * gb / cublas_ms * 1e3 / copy_gbs,
                          "splits": gemv.config_for(n, k, x.element_size(), x.get_device()).splits,
                          "rel_err_vs_cublas": error}
                records.append(record)
                print(f"{model:11s} {proj:8s} {n:7d} {k:6d} {rows:4d} {record['gemv_us']:8.2f} "
                      f"{record['cublas_us']:9.2f} {record['speedup']:8.2f} {record['gemv_pct_copy']:10.1f} "
                      f"{record['cublas_pct_copy']:12.1f} {record['splits']:6d} {error:8.1e}")
                del x, weight
    return records


def sweep(copy_gbs: float, rows_list: list[int]) -> list[dict]:
    from nanovllm.kernels import gemv
    records = []
    print(f"\nsweep, {MODELS[0]}: {'proj':8s} {'rows':>4s} {'block_n':>7s} {'block_k':>7s} {'per SM':>6s} "
          f"{'stages':>6s} {'splits':>6s} {'us':>8s} {'%copy':>6s}")
    for (proj, (n, k)), rows in itertools.product(projections(MODELS[0]).items(), rows_list):
        x, weight = operands(rows, n, k)
        expected = F.linear(x, weight)
        gb = moved_bytes(rows, n, k, x.element_size()) / 1e9
        for (block_n, block_k), per_sm, stages in itertools.product(SWEEP_TILES, (1, 2, 4), (2, 3)):
            config = gemv.config_for(n, k, x.element_size(), x.get_device(), block_n=block_n, block_k=block_k,
                                     programs_per_sm=per_sm, num_stages=stages)
            out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
            try:
                gemv.launch(x, weight, None, out, config)
            except OutOfResources as exc:  # shared memory or registers: the tiling does not fit
                print(f"{'':18s}{proj:8s} {rows:4d} {block_n:7d} {block_k:7d} {per_sm:6d} {stages:6d}  {exc}")
                continue
            us = kernels.benchmark_kernel(gemv.launch, x, weight, None, out, config) * 1e3
            record = {"proj": proj, "n": n, "k": k, "rows": rows, **config._asdict(), "programs_per_sm": per_sm,
                      "us": us, "pct_copy": 100 * gb / us * 1e6 / copy_gbs, "rel_err_vs_cublas": relative_error(out, expected)}
            records.append(record)
            print(f"{'':18s}{proj:8s} {rows:4d} {block_n:7d} {block_k:7d} {per_sm:6d} {stages:6d} "
                  f"{config.splits:6d} {us:8.2f} {record['pct_copy']:6.1f}"
                  + ("" if record["rel_err_vs_cublas"] < 2e-2 else f"  MISMATCH {record['rel_err_vs_cublas']:.1e}"))
        best = min((r for r in records if r["proj"] == proj and r["rows"] == rows), key=lambda r: r["us"])
        print(f"{'':18s}best: block_n {best['block_n']} block_k {best['block_k']} per SM {best['programs_per_sm']} "
              f"stages {best['num_stages']}: {best['us']:.2f} us")
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/gemv")
    parser.add_argument("--sweep", action="store_true", help="also time other GEMV tilings")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    if not torch.cuda.is_available() or kernels.backend_for("cuda") != "triton":
        raise SystemExit("bench_gemv needs a CUDA GPU with the Triton kernels")
    copy_gbs = copy_rate_gbs(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "torch": torch.__version__,
              "compare": compare(copy_gbs)}
    if args.sweep:
        result["sweep"] = sweep(copy_gbs, args.sweep_rows)
    print(f"wrote {write_json(result, args.out, 'gemv.json')}")


if __name__ == "__main__":
    main()
