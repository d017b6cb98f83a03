"""A cheaper eager launch for the package's Triton kernels.

`kernel[grid](*args)` (Triton 3.6, JITFunction.run) does on every call what only a new
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

Under TRITON_INTERPRET=1 `triton.jit` returns no JITFunction and the kernel is left as it is.
NANOVLLM_FAST_LAUNCH=0 (or `launch.enabled = False`) sends every launch through Triton's path.

Programmatic dependent launch (Hopper and later): every kernel of the package calls
`await_previous_kernel` before it reads anything an earlier kernel of the step may write, and
is launched with `launch_pdl`, so the GPU schedules its programs
while the kernel before it in the stream is still running, and they start work the moment
that kernel's results are visible, instead of after a full launch round trip.
NANOVLLM_PDL=0 turns it off."""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nanovllm.kernels import dispatch

enabled = os.environ.get("NANOVLLM_FAST_LAUNCH", "1") != "0"
# The internals used here (JITFunction.device_caches and its binder, the arguments of
# CompiledKernel.run, triton.knobs) are Triton 3.6's; other versions keep Triton's own path.
SUPPORTED = triton.__version__.startswith("3.6.")
dependent_launch_enabled = os.environ.get("NANOVLLM_PDL", "1") != "0"
_dependent_launch: dict[int, dict] = {}


def dependent_launch(device_index: int) -> dict:
    """Launch arguments for a kernel whose tensors are on `device_index` (Tensor.get_device(),
    -1 for the CPU): its PDL constexpr and Triton's launch_pdl option, on for GPUs of compute
    capability 9 and later, off under TRITON_INTERPRET=1 (the interpreter runs no inline PTX,
    whatever the tensors' device). Cached: this runs on every launch."""
    options = _dependent_launch.get(device_index)
    if options is None:
        on = (dependent_launch_enabled and device_index >= 0 and not dispatch.INTERPRETER
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


def fast_launch(kernel):
    """Decorator over @triton.jit; call sites keep `kernel[grid](*args, **constexprs)`."""
    return FastLauncher(kernel) if SUPPORTED and isinstance(kernel, JITFunction) else kernel


def cache_key(binder, device: int, args: tuple, kwargs: dict):
    """-> (key, the arguments in parameter order) of a call on `device`. `binder` is the
    function Triton generates per kernel and device (JITFunction.device_caches[device][4])."""
    bound, specialization, options = binder(*args, **kwargs)
    return (device, *specialization, *options.items()), bound.values()


def _observed() -> bool:
    """Debug mode, instrumentation and launch hooks (profilers) live in Triton's own path."""
    runtime = triton.knobs.runtime
    return bool(runtime.debug or triton.knobs.compilation.instrumentation_mode
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

    def launch(self, grid, *args, **kwargs):
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
        compiled.run(x, y, z, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound)
        return compiled
