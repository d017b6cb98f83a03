"""Checks every custom kernel against a float64 reference and, on a GPU, times it against eager
PyTorch and torch.compile.

    python test_custom_kernels.py [--out DIR] [--quick]

The same as `python -m benchmarks.bench_kernels`, which describes what runs and what it
writes; the cases are in benchmarks/kernel_cases.py."""
from benchmarks.bench_kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
