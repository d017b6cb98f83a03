"""CUDA C++ kernels, built on first use with torch.utils.cpp_extension.load_inline.

`load(name, source, declarations)` compiles a .cu file of this package for the current
device's architecture only, into NANOVLLM_CUDA_CACHE (default ~/.cache/nanovllm/cuda) under a
folder named by the hash of the source, the architecture and the torch / CUDA versions: a
later process loads the built library, an edited source builds anew. An fcntl lock on that
folder makes processes that start together build once and the others wait and load. Where
no GPU, nvcc or C++ compiler is there, or the build fails, `load` returns None after one
warning a process, and the caller keeps its Triton path."""
import fcntl
import functools
import hashlib
import os
import shutil
import warnings

import torch

_warned = False


def cache_root() -> str:
    return os.environ.get("NANOVLLM_CUDA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm", "cuda")


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None or not os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        return "no CUDA toolkit (nvcc) found"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found"
    return None


def warn_fallback_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"nanovllm CUDA C++ kernels unavailable, using the Triton kernels ({reason})", stacklevel=3)


@functools.cache
def load(name: str, source: str, declarations: str, functions: tuple[str, ...]):
    """The built extension module of kernels/cuda/<source> (functions `functions`, declared in
    `declarations`), or None (see the module docstring)."""
    reason = unavailable_reason()
    if reason is not None:
        warn_fallback_once(reason)
        return None
    with open(os.path.join(os.path.dirname(__file__), source)) as f:
        code = f.read()
    major, minor = torch.cuda.get_device_capability()
    key = hashlib.sha256("\0".join((code, declarations, f"{major}{minor}", torch.__version__,
                                    str(torch.version.cuda))).encode()).hexdigest()[:16]
    build_dir = os.path.join(cache_root(), f"{name}_{key}")
    os.makedirs(build_dir, exist_ok=True)
    from torch.utils.cpp_extension import load_inline
    with open(os.path.join(build_dir, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            return load_inline(name=f"{name}_{key}", cpp_sources=declarations, cuda_sources=code,
                               functions=list(functions), build_directory=build_dir,
                               # one architecture: an -arch flag keeps torch from adding every visible one
                               extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"])
        except Exception as exc:  # a compiler error, a missing header: the Triton path serves
            warn_fallback_once(f"building {source} failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}")
            return None
