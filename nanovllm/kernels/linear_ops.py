"""The public projections: `linear` and the fused norm / embedding / activation variants around
it, and where their rows go. CUDA inputs of at most GEMV_MAX_ROWS rows take the small-batch GEMV
(gemv.py) and one or two rows its fused row kernel, while `dispatch.gemv_enabled`; larger
batches take cuBLAS through F.linear, or the separate kernels."""
import math

import torch
import torch.nn.functional as F

from nanovllm.kernels import dispatch
from nanovllm.kernels.checks import (GEMV_DTYPES, require, require_float, require_gated, require_gemv_operands,
                                     require_last_dim_vector, require_like, require_linear_operands, require_weight)
from nanovllm.kernels.dispatch import implementation
from nanovllm.kernels.ops import fused_add_rms_norm, gelu_and_mul, rms_norm, silu_and_mul

GEMV_MAX_ROWS = 16  # nanovllm.kernels.gemv.MAX_ROWS, without importing Triton here
GEMV_ROW_MAX_ROWS = 2  # nanovllm.kernels.gemv.ROW_MAX_ROWS: where norm_linear, embed_norm_linear, linear_act
# and act_linear fuse


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) for at most GEMV_MAX_ROWS rows of x (decode
    batches): a split-K GEMV that reads the weight once at close to copy bandwidth (one or two
    rows: a split-free kernel). float16, bfloat16 or float32. Returns a new contiguous [..., N]
    tensor. `prefetch`: a contiguous tensor on x's device, read into the L2 cache while the
    split-K kernel waits for its input (the next projection's weight; the one- and two-row
    kernel does not prefetch); it does not change the result."""
    require(isinstance(x, torch.Tensor) and x.dtype in GEMV_DTYPES, "x",
            "must be a float16, bfloat16 or float32 tensor")
    require(x.dim() >= 1 and math.prod(x.shape[:-1]) <= GEMV_MAX_ROWS, "x",
            lambda: f"must be [..., K] with at most {GEMV_MAX_ROWS} rows, got shape {tuple(x.shape)}")
    require_gemv_operands(x, weight, bias, prefetch, x.shape[-1])
    return implementation("small_batch_linear", x.device)(x, weight, bias, prefetch)


def _few_rows_on_gemv(x: torch.Tensor, rows: int | None = None) -> bool:
    """x's rows (`rows` where x is not the input itself) go to the row kernel."""
    return (dispatch.gemv_enabled and x.is_cuda and x.dtype in GEMV_DTYPES
            and (x.numel() <= GEMV_ROW_MAX_ROWS * x.shape[-1] if rows is None else rows <= GEMV_ROW_MAX_ROWS))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, prefetch: torch.Tensor | None = None,
                leave_room: bool = False, activation: str | None = None):
    """A pre-norm decoder's norm and the projection after it: with a residual,
    (linear(rms_norm(x + residual)), x + residual), without one (linear(rms_norm(x)), x).
    One kernel where one or two CUDA rows go to the small-batch GEMV's row kernel (decode of 1-2),
    else fused_add_rms_norm or rms_norm, then linear(). May reuse the memory of x and residual:
    callers must not read either afterwards. `leave_room`: the kernel after this one starts its
    programs beside this one's and needs room on every SM (the decode attention after qkv): the
    row kernel then puts fewer of its programs on an SM. `activation` ("silu", "gelu",
    "gelu_tanh"): weight is a gated MLP's gate above its up, and the projection's output is
    linear_act's, act(gate) * up (in the same kernel where it fuses)."""
    require_last_dim_vector(x, norm_weight, "norm_weight")
    if residual is not None:
        require_like(residual, x, "residual", "x")
    require_weight(weight, x.shape[-1])
    require_linear_operands(x, weight, bias, prefetch)  # before any kernel consumes x and residual
    if activation is not None:
        _require_gated_weight(weight, activation)
    if _few_rows_on_gemv(x):
        fused = implementation("norm_linear", x.device)(x, residual, norm_weight, eps, weight, bias, prefetch,
                                                         leave_room, activation)
        if fused is not None:
            return fused
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    if activation is None:
        return linear(normed, weight, bias, prefetch), residual
    return _checked_linear_act(normed, weight, bias, prefetch, activation), residual


def embed_norm_linear(input_ids: torch.Tensor, embed_weight: torch.Tensor, embed_scale: float | None,
                      norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      leave_room: bool = False):
    """A decoder's first norm and projection from its token ids: (linear(rms_norm(e)), e) for
    e = embed_weight[input_ids], times embed_scale rounded to the table's dtype where that is
    not None (Gemma). One kernel where one or two ids on CUDA go to the row kernel, which looks
    their rows up in its prologue (the embedding's own launch leaves small decode steps); else
    the lookup, then norm_linear. Ids must lie in [0, embed_weight.shape[0]): the kernel reads
    the rows they name unchecked, and the engine rejects prompts with other ids."""
    require(isinstance(input_ids, torch.Tensor) and input_ids.dtype == torch.int64 and input_ids.dim() == 1,
            "input_ids", "must be a 1-D int64 tensor")
    require_float(embed_weight, "embed_weight")
    require(embed_weight.dim() == 2, "embed_weight", lambda: f"must be [vocab, K], got shape {tuple(embed_weight.shape)}")
    require(input_ids.device == embed_weight.device, "input_ids",
            lambda: f"device {input_ids.device} differs from embed_weight's {embed_weight.device}")
    require(embed_scale is None or isinstance(embed_scale, float), "embed_scale", "must be a float or None")
    require_last_dim_vector(embed_weight, norm_weight, "norm_weight")
    require_weight(weight, embed_weight.shape[1])
    require_linear_operands(embed_weight, weight, bias, None)
    if _few_rows_on_gemv(embed_weight, input_ids.numel()):
        fused = implementation("embed_norm_linear", embed_weight.device)(
            input_ids, embed_weight, embed_scale, norm_weight, eps, weight, bias, leave_room)
        if fused is not None:
            return fused
    embedded = F.embedding(input_ids, embed_weight)
    if embed_scale is not None:
        embedded = embedded * embed_scale  # computed in fp32 for half dtypes, then rounded
    return norm_linear(embedded, None, norm_weight, eps, weight, bias, None, leave_room)


_GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu": lambda x: gelu_and_mul(x, "none"),
                      "gelu_tanh": lambda x: gelu_and_mul(x, "tanh")}


def _require_activation(activation: str) -> None:
    require(activation in _GATED_ACTIVATIONS, "activation",
            lambda: f"must be one of {sorted(_GATED_ACTIVATIONS)}, got {activation!r}")


def _require_gated_weight(weight: torch.Tensor, activation: str) -> None:
    _require_activation(activation)
    require(weight.shape[0] % 2 == 0, "weight",
            lambda: f"must hold a gate and an up projection of equal size, got {weight.shape[0]} rows")


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               prefetch: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """act(y[..., :N]) * y[..., N:] for y = linear(x, weight, bias) and weight [2N, K]: a gated
    MLP's gate_up projection with its activation. activation: "silu", "gelu" (erf) or
    "gelu_tanh". One kernel where one or two CUDA rows go to the row kernel, which computes
    each feature's gate and up in one program and the activation once, in its epilogue; else
    linear(), then the activation kernel."""
    require_weight(weight, x.shape[-1])
    require_linear_operands(x, weight, bias, prefetch)
    _require_gated_weight(weight, activation)
    return _checked_linear_act(x, weight, bias, prefetch, activation)


def _checked_linear_act(x, weight, bias, prefetch, activation: str) -> torch.Tensor:
    """linear_act on operands already checked (norm_linear's unfused path checks them first)."""
    if _few_rows_on_gemv(x):
        fused = implementation("linear_act", x.device)(x, weight, bias, prefetch, activation)
        if fused is not None:
            return fused
    return _GATED_ACTIVATIONS[activation](linear(x, weight, bias, prefetch))


def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               prefetch: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """linear(act(x[..., :K]) * x[..., K:]) for x [..., 2K] and weight [N, K]: a gated MLP's
    activation and down projection. activation: "silu", "gelu" (erf) or "gelu_tanh". One
    kernel where one or two CUDA rows go to the small-batch GEMV's row kernel, else the activation
    kernel then linear()."""
    _require_activation(activation)
    require_gated(x)
    require_weight(weight, x.shape[-1] // 2)
    require_linear_operands(x, weight, bias, prefetch)
    if _few_rows_on_gemv(x):
        fused = implementation("act_linear", x.device)(x, weight, bias, prefetch, activation)
        if fused is not None:
            return fused
    return linear(_GATED_ACTIVATIONS[activation](x), weight, bias, prefetch)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that CUDA inputs of at most GEMV_MAX_ROWS rows go to small_batch_linear
    (unless dispatch.gemv_enabled is off), with `prefetch`. Under a captured graph the choice is
    that of the captured batch size."""
    if dispatch.gemv_enabled and x.is_cuda and x.dtype in GEMV_DTYPES and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return small_batch_linear(x, weight, bias, prefetch)
    return F.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a float8_e4m3fn W times its fp32 multipliers `scale`: [N, 1] per output
    row (block None) or one per block[0] x block[1] tile (kernels/fp8.py)."""
    require(weight.dtype == torch.float8_e4m3fn, "weight", f"must be float8_e4m3fn, got {weight.dtype}")
    return implementation("fp8_linear", x.device)(x, weight, scale, block, bias)
