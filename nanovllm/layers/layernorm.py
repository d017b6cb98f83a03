import torch
from torch import nn

from nanovllm import kernels


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension. Called with a residual it first adds it and
    returns (normed, new residual), the pre-norm decoder's add-then-norm in one kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
