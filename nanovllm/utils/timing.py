"""How the benchmarks and tests time GPU work: capture-and-replay of CUDA graphs, the median
time of one kernel call, and the device's copy rate that every "% of copy bandwidth" figure
is divided by.

`benchmark_kernel` captures the calls into a CUDA graph and times the replays, so the result
is device time without Python launch overhead: what the engine pays when decode runs under
CUDA graphs, and a fair ground for comparing a Triton launcher, eager PyTorch and a
torch.compile'd function, whose host costs differ a lot. A function that cannot be captured
(one that synchronises with the host) is timed with events around eager calls instead."""
import collections
import itertools
import math
import statistics
import time
import warnings

import torch

_L2_BYTES = 64 << 20  # larger than any Hopper L2 (50-60 MB)
_MAX_COPIES = 32
_GRAPH_MS = 2.0  # device time one replay aims at, so its launch cost is noise


def warm_up(fn, calls: int = 1) -> None:
    """Runs fn() `calls` times on a side stream, as graph capture wants: lazy initialisations
    (compilation, cuBLAS workspaces, the allocator's pools) happen here, outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def capture(fn, calls: int = 1, warmup: int = 1):
    """-> (graph, output of the last captured call): a CUDA graph of `calls` calls of fn(),
    after `warmup` calls on a side stream. A replay reruns the calls on the memory they were
    captured with, so new inputs are copied into the captured ones first. Raises
    RuntimeError if fn synchronises with the host."""
    warm_up(fn, warmup)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def device_copy_gbs(device="cuda", nbytes: int = 1 << 30) -> float:
    """The device's copy rate in GB/s: a device-to-device copy of `nbytes` (1 GiB), counting
    the bytes read and written, the median of 20 eager copies. Eager, not replayed from a
    graph: a replayed copy measures well below the eager one, which would understate the
    device (docs/rejected.md). On the CPU a wall clock times a plain copy (a rough figure, for
    smoke runs)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    on_cuda = src.is_cuda
    times = []
    for i in range(25):
        if on_cuda:
            ms = time_events(lambda: dst.copy_(src))
        else:
            start = time.perf_counter()
            dst.copy_(src)
            ms = (time.perf_counter() - start) * 1e3
        if i >= 5:
            times.append(ms)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e6


def _storage_key(tensor: torch.Tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()


def clone_arguments(args, kwargs=None):
    """Copies of the tensor arguments (others pass through): each a view of a copy of its
    original's whole storage, at the same offset and strides, and arguments that share a
    storage share the copy. Views of one packed qkv output thus stay one buffer, as in the
    model; cloned one by one, their rows would start at the same offsets of separate buffers
    and fall on fewer memory channels, which slows them. A view of a large buffer (one
    layer's slice of a whole KV cache) costs a copy of all of it."""
    storages = {}

    def clone(value):
        if not isinstance(value, torch.Tensor):
            return value
        key = _storage_key(value)
        if key not in storages:
            storages[key] = value.untyped_storage().clone()
        return value.new_empty(0).set_(storages[key], value.storage_offset(), value.shape, value.stride())
    return [clone(a) for a in args], {k: clone(v) for k, v in (kwargs or {}).items()}


def _copies_to_defeat_cache(args, kwargs) -> int:
    """Enough copies that a round of calls touches twice the L2 cache, counted in the storages
    clone_arguments copies."""
    storages = {_storage_key(v): v.untyped_storage().nbytes() for v in [*args, *kwargs.values()]
                if isinstance(v, torch.Tensor)}
    return max(1, min(_MAX_COPIES, -(-2 * _L2_BYTES // max(sum(storages.values()), 1))))


def benchmark_kernel(fn, *args, warmup: int = 20, iters: int = 100, **kwargs) -> float:
    """Median milliseconds of one fn(*args, **kwargs): CUDA-graph replays on a GPU (see the
    module docstring), a wall clock on the CPU. Inputs and outputs rotate through enough copies
    to exceed the L2 cache; an in-place fn keeps working on the same copies."""
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in [*args, *kwargs.values()])
    if not on_cuda:
        return _time_cpu(fn, args, kwargs, warmup, iters)
    # consecutive calls read different copies, so small inputs are not timed out of the L2 cache
    variants = [clone_arguments(args, kwargs) for _ in range(_copies_to_defeat_cache(args, kwargs))]
    # Results stay alive for a round of the copies: otherwise every call would allocate its
    # output where the last call's was freed and write to memory still in L2.
    results = collections.deque(maxlen=len(variants))
    rotation = itertools.cycle([lambda a=a, k=k: results.append(fn(*a, **k)) for a, k in variants])

    def call():
        next(rotation)()
    warm_up(call, max(warmup, len(variants)))
    eager_ms = statistics.median(time_events(call) for _ in range(5))
    # enough calls to fill _GRAPH_MS (the eager estimate over-states small kernels) and at
    # least one pass over the copies
    count = max(len(variants), min(256, math.ceil(_GRAPH_MS / max(eager_ms, 1e-3))))
    try:
        graph, _ = capture(call, count, warmup=0)
    except RuntimeError as exc:  # a host synchronisation inside fn: no graph possible
        warnings.warn(f"benchmark_kernel: not capturable, timing eager calls ({exc})", stacklevel=2)
        torch.cuda.synchronize()
        return statistics.median(time_events(call) for _ in range(iters))
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(time_events(graph.replay) for _ in range(iters)) / count


def time_events(call) -> float:
    """Milliseconds of call() on the current stream, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_cpu(fn, args, kwargs, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
