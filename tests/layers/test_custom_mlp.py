"""CustomGatedMLP.normed_forward, the decoder's MLP after its post-attention norm: the norm,
gate_up and the activation through kernels.norm_linear(activation=...), then down, against the
module with use_custom_kernels=False (the norm and gate_up through kernels.norm_linear, the
activation in plain PyTorch). Tolerance: relative error 1e-5 in fp32, 2e-2 in bf16."""
import pytest
import torch
from torch import nn

from nanovllm.layers.custom_mlp import ACTIVATIONS, CustomGatedMLP
from nanovllm.layers.layernorm import RMSNorm


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _pair(hidden_act: str, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    fused = CustomGatedMLP(64, 96, hidden_act).to(device=device, dtype=dtype)
    for p in fused.parameters():
        nn.init.normal_(p, std=64 ** -0.5)
    plain = CustomGatedMLP(64, 96, hidden_act, use_custom_kernels=False).to(device=device, dtype=dtype)
    plain.load_state_dict(fused.state_dict())
    norm = RMSNorm(64, 1e-6).to(device=device, dtype=dtype)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    return fused, plain, norm


def _check(hidden_act: str, device: str, dtype: torch.dtype, rows: int, tolerance: float):
    fused, plain, norm = _pair(hidden_act, device, dtype)
    for with_residual in (False, True):
        x = torch.randn(rows, 64, device=device, dtype=dtype)
        residual = torch.randn(rows, 64, device=device, dtype=dtype) if with_residual else None
        expected, expected_residual = plain.normed_forward(x.clone(), norm,
                                                           None if residual is None else residual.clone())
        out, new_residual = fused.normed_forward(x.clone(), norm, None if residual is None else residual.clone())
        assert out.shape == (rows, 64) and out.dtype == dtype
        assert _relative_error(out, expected) <= tolerance
        assert torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("hidden_act", sorted(ACTIVATIONS))
def test_normed_forward_matches_the_plain_path(hidden_act):
    _check(hidden_act, "cpu", torch.float32, 3, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_normed_forward_on_the_gpu(hidden_act, rows):
    """One and two rows take the row kernel with the gated epilogue, five the unfused kernels."""
    _check(hidden_act, "cuda", torch.bfloat16, rows, 2e-2)
