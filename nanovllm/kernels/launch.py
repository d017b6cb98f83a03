"""A cheaper eager launch for the package's Triton kernels.

`kernel[grid](*args)` (JITFunction.run, Triton 3.6 to 3.9) does on every call what only a new
specialization needs: it reads knobs, binds and specializes the arguments, formats the
options into a string for the cache key, re-checks the kernel's globals, builds launch
metadata for profiler hooks and has the C launcher call both (empty) hook chains. Stacked on
`@triton.jit`, `fast_launch` keeps that path for the first call of every specialization
(compilation, Triton's caches and hooks) and afterwards calls the compiled kernel's launcher
directly, the way `CompiledKernel[grid]` does.

Correctness rests on the cache key: it is the specialization list of Triton's own binder
(dtype and 16-byte alignment of each pointer, each int's width, divisibility by 16 and
equality to 1 unless in do_not_specialize, constexpr values) with the launch options
(num_warps, ...) and the current device. Whatever makes Triton compile a new variant makes
a new key. The stream is read on every call, so launches follow torch.cuda.stream and graph
capture as Triton's do. Not re-checked after the first call: the values of globals the
kernel reads (these kernels take their constants as arguments).

Under TRITON_INTERPRET=1 `triton.jit` returns no JITFunction and the kernel is left as it is;
the interpreter's masked loads and stores get their masks as bool (`_interpret_masks_as_bool`).
NANOVLLM_FAST_LAUNCH=0 (or `launch.enabled = False`) sends every launch through Triton's path,
and so does a Triton whose own launch path no longer does what the direct one repeats
(`changed_internals`; tests/kernels/test_launch.py fails then).

Programmatic dependent launch (Hopper and later): every kernel of the package calls
`await_previous_kernel` before it reads anything an earlier kernel of the step may write, and
is launched with `launch_pdl`, so the GPU schedules its programs
while the kernel before it in the stream is still running, and they start work the moment
that kernel's results are visible, instead of after a full launch round trip.
NANOVLLM_PDL=0 turns it off."""
import functools
import inspect
import os
import re
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nanovllm.kernels.interpreter import INTERPRETER

# The steps of JITFunction.run that FastLauncher relies on, as its source spells them: where the
# binder lives and what it returns (the cache key's parts), and the launch it repeats.
_RUN_STEPS = (
    "kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[device]",
    "bound_args, specialization, options = binder(*args, **kwargs)",
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
    "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())",
)
# Options that run adds from triton.knobs before binding; _observed sends launches to Triton's
# path while any is set, so they need not be in FastLauncher's key.
_KNOB_OPTIONS = ("debug", "instrumentation_mode", "fpsan_homomorphic_casts")


def changed_internals() -> list[str]:
    """What FastLauncher relies on that the installed Triton's launch path does differently;
    empty for Triton 3.6 to 3.9, whose sources were read for it."""
    try:
        run = " ".join(inspect.getsource(JITFunction.run).split())
    except OSError:  # no source shipped
        return ["JITFunction.run's source"]
    changed = [step for step in _RUN_STEPS if step not in run]
    changed += [f"run's option {name}" for name in re.findall(r'kwargs\["(\w+)"\] =', run)
                if name not in _KNOB_OPTIONS]
    # occupancy_cap's padding replaces the shared memory bytes of the packed metadata
    metadata = SimpleNamespace(num_warps=4, num_ctas=2, shared=1024)
    if make_backend(GPUTarget("cuda", 90, 32)).pack_metadata(metadata) != (4, 2, 1024):
        changed.append("packed_metadata as (num_warps, num_ctas, shared memory bytes)")
    return changed


def _interpret_masks_as_bool() -> None:
    """Triton's interpreter keeps a scalar comparison's result in its operands' dtype, so a mask
    joining one to a block (`(cols < K) & (m < M)`) holds int32 data, which the interpreter's
    masked load and store reject from Triton 3.9 on. Compiled kernels get an i1 mask either way."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def as_bool(mask):
        if isinstance(mask, TensorHandle) and mask.data.dtype != bool:
            return TensorHandle(mask.data.astype(bool), mask.dtype)
        return mask  # bool already, or a tensor descriptor's own array of bools

    def masked_load(self, ptrs, mask, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store


def _interpret_fp8_stores_as_torch() -> None:
    """Triton's interpreter rounds to float8 e4m3 without carrying into the exponent (126 -> 64)
    and flushes its subnormals; the GPU rounds to nearest even, as torch does, which converts
    there instead."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return convert(self, src, dst_type, rounding_mode)
        fp8 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
        return TensorHandle(fp8.view(torch.uint8).numpy(), dst_type.scalar)

    convert = InterpreterBuilder.create_fp_to_fp
    InterpreterBuilder.create_fp_to_fp = fp_to_fp


if INTERPRETER:
    _interpret_masks_as_bool()
    _interpret_fp8_stores_as_torch()
enabled = os.environ.get("NANOVLLM_FAST_LAUNCH", "1") != "0"
SUPPORTED = not changed_internals()
dependent_launch_enabled = os.environ.get("NANOVLLM_PDL", "1") != "0"
_dependent_launch: dict[int, dict] = {}


def dependent_launch(device_index: int) -> dict:
    """Launch arguments for a kernel whose tensors are on `device_index` (Tensor.get_device(),
    -1 for the CPU): its PDL constexpr and Triton's launch_pdl option, on for GPUs of compute
    capability 9 and later, off under TRITON_INTERPRET=1 (the interpreter runs no inline PTX,
    whatever the tensors' device). Cached: this runs on every launch."""
    options = _dependent_launch.get(device_index)
    if options is None:
        on = (dependent_launch_enabled and device_index >= 0 and not INTERPRETER
              and torch.cuda.get_device_capability(device_index)[0] >= 9)
        options = _dependent_launch[device_index] = {"PDL": on, "launch_pdl": on}
    return options


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """The first statement of every kernel here, but for loads of what no kernel of the step
    writes: step metadata (paged attention), weights (the GEMV), keys cached by earlier steps
    (decode attention). Waits until the kernel before it in the stream has finished and its
    writes are visible, then lets the kernel after it be scheduled: its programs wait here in
    turn, so no kernel reads its predecessor's unfinished output. Kernels without PDL (cuBLAS, PyTorch's) neither signal early nor start
    early, and order with these as usual."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def occupancy_cap(device_index: int, programs_per_sm: int) -> dict:
    """Launch keywords that let at most `programs_per_sm` programs of a fast-launched kernel
    share an SM: its dynamic shared memory is padded to a share of the SM's. Programs that
    start while the kernel before is leaving otherwise fill the SMs that free first, as many
    as registers allow, and the kernel after finds no room there to start and issue its loads
    before its wait. Only for kernels with programmatic dependent launch on a GPU, and not
    through Triton's own launch path, which has no such option and ignores the keyword (the
    first call of each specialization, Triton's launch hooks, NANOVLLM_FAST_LAUNCH=0); {} where
    launches take no keyword of fast_launch's (the CPU, the interpreter, a Triton with
    changed_internals) or run without PDL."""
    if not (SUPPORTED and dependent_launch(device_index)["PDL"]):
        return {}
    per_sm = torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor
    # Above 48 KB a kernel needs an opt-in attribute: there the cap is looser than asked.
    return {"min_shared_memory": min(per_sm // (programs_per_sm + 1) + 1, 48 << 10)}


def fast_launch(kernel):
    """Decorator over @triton.jit; call sites keep `kernel[grid](*args, **constexprs)`."""
    return FastLauncher(kernel) if SUPPORTED and isinstance(kernel, JITFunction) else kernel


def cache_key(binder, device: int, args: tuple, kwargs: dict):
    """-> (key, the arguments in parameter order) of a call on `device`. `binder` is the
    function Triton generates per kernel and device (JITFunction.device_caches[device][4])."""
    bound, specialization, options = binder(*args, **kwargs)
    return (device, *specialization, *options.items()), bound.values()


def _observed() -> bool:
    """Debug mode, instrumentation, the float sanitizer's casts (Triton 3.9), extra compiler
    passes (which run adds to the specialization from 3.7 on) and launch hooks (profilers) live in
    Triton's own path."""
    runtime, compilation = triton.knobs.runtime, triton.knobs.compilation
    return bool(runtime.debug or compilation.instrumentation_mode
                or getattr(compilation, "fpsan_homomorphic_casts", False)
                or runtime.add_stages_inspection_hook is not None
                or getattr(runtime.launch_enter_hook, "calls", True)
                or getattr(runtime.launch_exit_hook, "calls", True))


class FastLauncher:
    """A @triton.jit kernel with its compiled variants, one per cache key, for direct launches."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self._compiled = {}  # (device, *specialization key) -> CompiledKernel

    def __getattr__(self, name):
        # The rest of the JITFunction (device_caches, arg_names...), for tools that inspect it.
        if name == "kernel":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, min_shared_memory: int = 0, **kwargs):
        """`min_shared_memory`: bytes of dynamic shared memory to reserve a program at least
        (occupancy_cap)."""
        kernel = self.kernel
        if not enabled or kernel.pre_run_hooks or _observed():
            return kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        key, bound = cache_key(kernel.device_caches[device][4], device, args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            # None again when a jit_cache_hook vetoed compilation: every call then goes this way
            compiled = self._compiled[key] = kernel[grid](*args, **kwargs)
            return compiled
        x, y, z = (*grid, 1, 1)[:3]
        metadata = compiled.packed_metadata  # (num_warps, num_ctas, shared memory bytes)
        if min_shared_memory > metadata[2]:
            metadata = (*metadata[:2], min_shared_memory)
        compiled.run(x, y, z, driver.active.get_current_stream(device), compiled.function,
                     metadata, None, None, None, *bound)
        return compiled
