from functools import partial

import torch
from torch import nn

from nanovllm import kernels
from nanovllm.utils.loader import copy_checked


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension. Called with a residual it first adds it and
    returns (normed, new residual), the pre-norm decoder's add-then-norm in one kernel.

    unit_offset: the checkpoint stores w for a scale of 1 + w (Gemma). The weight loader adds
    the 1 as it copies, so the parameter holds the scale itself and the same fused kernels
    serve. The scale is kept in fp32 whatever the model dtype: near 1.0 bf16 steps by 2^-7,
    which would drop most of a small w, while transformers adds the 1 to w in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32 if unit_offset else None))
        if unit_offset:
            # w itself is held in the model dtype, as in transformers, before the 1 is added
            self.weight.weight_loader = partial(_load_plus_one, dtype=torch.get_default_dtype())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor, name: str = "", *, dtype: torch.dtype) -> None:
    copy_checked(param, loaded.to(dtype).float() + 1, name)
