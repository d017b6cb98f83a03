"""Chooses, once per process, whether the public kernel functions run their Triton kernels
or the PyTorch references in `reference.py`.

NANOVLLM_KERNEL_BACKEND=auto (default): Triton for CUDA tensors when Triton imports, the
reference otherwise (said once in a warning). With TRITON_INTERPRET=1, "auto" also sends CPU
tensors to Triton's interpreter. "triton" never falls back: a call Triton cannot serve raises.
"torch" always uses the references.

NANOVLLM_SAMPLER=triton (default) | cuda | torch picks the implementation of `sample` where the
Triton kernels serve: the Triton kernel, the CUDA C++ one (kernels/cuda; built on first use,
the Triton one after a warning where it cannot be), or the reference. The CUDA C++ sampler
reads no token bitmask or penalties: calls with them take the Triton kernels.

NANOVLLM_PAGED_DECODE=cuda (default) | triton picks the kernel of paged_attention's unsplit
decode steps where the CUDA C++ one serves them (kernels/cuda/paged_decode.py; built on first
use, the Triton kernel after a warning where it cannot be).

NANOVLLM_GEMV=1 (default) | 0: whether `linear` and its fused variants send small CUDA batches
to the Triton small-batch GEMV (kernels/linear_ops.py says which), or every batch to cuBLAS."""
import functools
import importlib
import os
import warnings

import torch

from nanovllm.kernels import reference
from nanovllm.kernels.interpreter import INTERPRETER

_BACKEND_CHOICES = ("auto", "triton", "torch")
_SAMPLER_CHOICES = ("triton", "cuda", "torch")
_PAGED_DECODE_CHOICES = ("cuda", "triton")
# Which module under nanovllm.kernels holds each op's Triton launcher.
_TRITON_MODULES = {
    "silu_and_mul": "activation",
    "gelu_and_mul": "activation",
    "fused_add_gelu": "activation",
    "element_wise_mul_add": "activation",
    "rms_norm": "norm",
    "fused_add_rms_norm": "norm",
    "apply_rotary_emb": "rotary",
    "store_kvcache": "kv_cache",
    "qk_norm_rope_store": "qk_norm_rope",
    "paged_attention": "attention",
    "qk_norm_rope_attention": "decode_attention",
    "sample": "sampling",
    "small_batch_linear": "gemv",
    "norm_linear": "gemv",
    "embed_norm_linear": "gemv",
    "linear_act": "gemv",
    "act_linear": "gemv",
    "fp8_linear": "fp8",
    "stage_inputs": "staging",
    "publish_tokens": "staging",
    "moe_topk": "moe",
    "moe_align": "moe",
    "fused_moe": "moe",
}


def _requested_backend() -> str:
    backend = os.environ.get("NANOVLLM_KERNEL_BACKEND", "auto").lower()
    if backend not in _BACKEND_CHOICES:
        raise ValueError(f"NANOVLLM_KERNEL_BACKEND must be one of {_BACKEND_CHOICES}, got {backend!r}")
    return backend


def _triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # any import failure means the same thing: no Triton here
        return f"triton does not import ({exc})"
    if not (INTERPRETER or torch.cuda.is_available()):
        return "no CUDA device and TRITON_INTERPRET is not set"
    return None


def _requested_sampler() -> str:
    sampler = os.environ.get("NANOVLLM_SAMPLER", "triton").lower()
    if sampler not in _SAMPLER_CHOICES:
        raise ValueError(f"NANOVLLM_SAMPLER must be one of {_SAMPLER_CHOICES}, got {sampler!r}")
    return sampler


def _requested_paged_decode() -> str:
    kernel = os.environ.get("NANOVLLM_PAGED_DECODE", "cuda").lower()
    if kernel not in _PAGED_DECODE_CHOICES:
        raise ValueError(f"NANOVLLM_PAGED_DECODE must be one of {_PAGED_DECODE_CHOICES}, got {kernel!r}")
    return kernel


REQUESTED_BACKEND = _requested_backend()
SAMPLER = _requested_sampler()
PAGED_DECODE = _requested_paged_decode()
TRITON_UNAVAILABLE_REASON = None if REQUESTED_BACKEND == "torch" else _triton_unavailable_reason()
KERNELS_AVAILABLE = REQUESTED_BACKEND != "torch" and TRITON_UNAVAILABLE_REASON is None
gemv_enabled = KERNELS_AVAILABLE and os.environ.get("NANOVLLM_GEMV", "1") != "0"
_warned_fallback = False


def backend_for(device: torch.device | str) -> str:
    """'triton' or 'torch': the implementation a call with tensors on `device` will run."""
    device = torch.device(device)
    if REQUESTED_BACKEND == "torch":
        return "torch"
    triton_serves = KERNELS_AVAILABLE and (device.type == "cuda" or INTERPRETER)
    if REQUESTED_BACKEND == "triton":
        if not triton_serves:
            reason = TRITON_UNAVAILABLE_REASON or f"tensors on {device} and TRITON_INTERPRET is not set"
            raise RuntimeError(f"NANOVLLM_KERNEL_BACKEND=triton but Triton cannot run: {reason}")
        return "triton"
    if not triton_serves:
        _warn_fallback_once(TRITON_UNAVAILABLE_REASON or f"tensors on {device}")
        return "torch"
    return "triton"


def graph_capturable(device: torch.device | str, sampling: bool = False) -> bool:
    """Whether the kernels on `device` run without host synchronisation (CUDA-graph safe);
    with `sampling`, `sample` too: the Triton sampler, the one tested under capture (the
    reference's draws synchronise)."""
    return (torch.device(device).type == "cuda" and backend_for(device) == "triton"
            and (not sampling or SAMPLER == "triton"))


def _warn_fallback_once(reason: str) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        # 6: the caller of the public kernel function (warn <- _warn_fallback_once <- backend_for <-
        # _implementation <- implementation <- kernels.<op>)
        warnings.warn(f"nanovllm kernels: using the PyTorch reference implementations ({reason})", stacklevel=6)


def implementation(op: str, device: torch.device):
    return _implementation(op, device.type)


@functools.cache  # the choice is fixed per process; looking it up must not cost every call
def _implementation(op: str, device_type: str):
    if backend_for(device_type) == "torch" or (op == "sample" and SAMPLER == "torch"):
        return getattr(reference, op)
    if op == "sample" and SAMPLER == "cuda":
        from nanovllm.kernels.cuda import sampling as cuda_sampling
        sample = cuda_sampling.sampler()
        if sample is not None:
            return functools.partial(_sample_routed, sample, importlib.import_module("nanovllm.kernels.sampling").sample)
    module = importlib.import_module(f"nanovllm.kernels.{_TRITON_MODULES[op]}")
    if op == "paged_attention":  # the launcher hands the calls that the CUDA C++ decode kernel serves to it
        return functools.partial(module.paged_attention, cuda_decode=PAGED_DECODE == "cuda")
    return getattr(module, op)


def _sample_routed(cuda_sample, triton_sample, *args, token_bitmask=None, penalties=None):
    """The CUDA C++ sampler's calls, those with a bitmask or penalties handed to Triton."""
    if token_bitmask is None and penalties is None:
        return cuda_sample(*args)
    return triton_sample(*args, token_bitmask=token_bitmask, penalties=penalties)
