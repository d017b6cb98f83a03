"""The gated MLP of Qwen/Llama-style decoders: down(act(gate(x)) * up(x)), with gate and up
in one matrix and the activation and product fused into one kernel. In decode steps of one or
two sequences they run inside a projection's kernel: after a norm, in the epilogue of gate_up's
(once per feature); on their own input, in the prologue of down's (in every program).

`python -m nanovllm.layers.custom_mlp` checks that the fused and the plain PyTorch paths
agree and times both on whatever device is there."""
import argparse
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import kernels
from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

class GatedActivation(NamedTuple):
    fused: Callable  # x[..., 2d] -> act(x[..., :d]) * x[..., d:], one kernel
    plain: Callable  # act in plain PyTorch
    name: str  # kernels.act_linear's name for it


# hidden_act name in a Hugging Face config -> its gated activation
ACTIVATIONS = {
    "silu": GatedActivation(kernels.silu_and_mul, F.silu, "silu"),
    "gelu": GatedActivation(lambda x: kernels.gelu_and_mul(x, approximate="none"), lambda x: F.gelu(x), "gelu"),
    "gelu_pytorch_tanh": GatedActivation(lambda x: kernels.gelu_and_mul(x, approximate="tanh"),
                                         lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
}


def resolve_activation(hidden_act: str) -> GatedActivation:
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act: {hidden_act!r} is not supported; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[hidden_act]


class CustomGatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 use_custom_kernels: bool = True):
        super().__init__()
        self.activation = resolve_activation(hidden_act)
        self.use_custom_kernels = use_custom_kernels
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def projections(self) -> tuple:
        """The linear layers a decode step runs, in order (read-ahead chain)."""
        return self.gate_up_proj, self.down_proj

    def normed_forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
        """(this MLP of norm(x + residual), x + residual), as gate_up_proj.normed_forward: the
        norm, gate_up and the activation one kernel in decode steps of one or two sequences."""
        if self.use_custom_kernels:
            activated, residual = self.gate_up_proj.normed_forward(x, norm, residual, self.activation.name)
            return self.down_proj(activated), residual
        gate_up, residual = self.gate_up_proj.normed_forward(x, norm, residual)
        return self.down(gate_up), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of gate_up's halves, their product and the down projection (one
        kernel in decode steps of one or two sequences: kernels.act_linear)."""
        if self.use_custom_kernels:
            return self.down_proj.activated_forward(gate_up, self.activation.name)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.activation.plain(gate) * up)


def _self_check(hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(0)
    mlp = CustomGatedMLP(hidden_size, intermediate_size).to(device=device, dtype=dtype)
    for p in mlp.parameters():
        nn.init.normal_(p, std=hidden_size ** -0.5)
    plain = CustomGatedMLP(hidden_size, intermediate_size, use_custom_kernels=False).to(device=device, dtype=dtype)
    plain.load_state_dict(mlp.state_dict())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"CustomGatedMLP {hidden_size}->{intermediate_size} {dtype} on {device} "
          f"(kernels: {kernels.backend_for(device)})")
    with torch.inference_mode():
        for tokens in (1, 64, 4096):
            x = torch.randn(tokens, hidden_size, device=device, dtype=dtype)
            fused, reference = mlp(x), plain(x)
            error = ((fused.double() - reference.double()).norm() / reference.double().norm()).item()
            fused_ms = kernels.benchmark_kernel(mlp, x)
            plain_ms = kernels.benchmark_kernel(plain, x)
            verdict = "ok" if error < tolerance else "MISMATCH"
            print(f"  tokens={tokens:5d} rel_err={error:.2e} {verdict}  fused {fused_ms:.4f} ms  "
                  f"plain {plain_ms:.4f} ms  speed-up {plain_ms / fused_ms:.2f}x")
            if error >= tolerance:
                raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=3072)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    _self_check(args.hidden_size, args.intermediate_size, dtype, args.device)
