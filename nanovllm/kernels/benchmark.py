"""Median timing of one kernel call, for test_custom_kernels.py and the layer self-checks."""
import statistics
import time

import torch


def _rotated_args(args, kwargs, count):
    """Clones of the tensor arguments, so that consecutive timed calls read different memory
    and small inputs are not timed out of the L2 cache."""
    def clone(value):
        return value.clone() if isinstance(value, torch.Tensor) else value
    return [([clone(a) for a in args], {k: clone(v) for k, v in kwargs.items()}) for _ in range(count)]


def _copies_to_defeat_cache(args, kwargs) -> int:
    tensor_bytes = sum(v.numel() * v.element_size() for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor))
    l2_bytes = 64 << 20  # larger than any Hopper L2 (50-60 MB)
    return max(1, min(32, -(-2 * l2_bytes // max(tensor_bytes, 1))))


def benchmark_kernel(fn, *args, warmup: int = 20, iters: int = 100, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs): CUDA events on a GPU, a wall clock on the CPU.
    Inputs rotate through enough copies to exceed the L2 cache."""
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in [*args, *kwargs.values()])
    variants = _rotated_args(args, kwargs, _copies_to_defeat_cache(args, kwargs) if on_cuda else 1)
    for i in range(warmup):
        a, k = variants[i % len(variants)]
        fn(*a, **k)
    times = []
    for i in range(iters):
        a, k = variants[i % len(variants)]
        times.append(_time_cuda(fn, a, k) if on_cuda else _time_cpu(fn, a, k))
    return statistics.median(times)


def _time_cuda(fn, args, kwargs) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args, **kwargs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_cpu(fn, args, kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1e3
