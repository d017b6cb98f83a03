import torch
from torch import nn

from nanovllm import kernels
from nanovllm.layers.linear import copy_checked


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension. Called with a residual it first adds it and
    returns (normed, new residual), the pre-norm decoder's add-then-norm in one kernel.

    unit_offset: the checkpoint stores w for a scale of 1 + w (Gemma). The weight loader adds
    the 1 as it copies, so the parameter holds the scale itself and the same fused kernels
    serve (in bf16 the scale is then rounded once, as the kernel's output is anyway)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        if unit_offset:
            self.weight.weight_loader = _load_plus_one

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    copy_checked(param, loaded.float() + 1, name)
