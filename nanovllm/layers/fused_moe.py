"""The mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE: a router picks each token's top-k
experts, whose gated MLPs run as one grouped GEMM pair over all experts (kernels.fused_moe).
The experts' weights are stacked, gate above up in one [E, 2I, H] tensor and down in
[E, H, I]; the checkpoint's per-expert tensors (`experts.<e>.gate_proj.weight`, ...) reach
their slices through the parameters' weight_loader. Under tensor parallelism every rank holds
all experts and a 1/tp slice of each one's intermediate dimension, like a dense MLP: its
output is a partial sum, all-reduced once a layer together with the shared expert's."""
import torch
from torch import nn

from nanovllm import distributed, kernels
from nanovllm.layers.custom_mlp import CustomGatedMLP, resolve_activation
from nanovllm.layers.linear import ReplicatedLinear, tensor_parallel_rank_and_size
from nanovllm.utils.loader import copy_checked

_SHARD_ROWS = {"gate": 0, "up": 1}  # w13's halves, in order


class FusedMoE(nn.Module):
    """The routed experts: forward(x, router_logits) -> this rank's partial sum of
    sum_j w_j * expert_j(x), not all-reduced."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, hidden_act: str = "silu"):
        super().__init__()
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size: {intermediate_size} does not split across "
                             f"tensor_parallel_size={self.tp_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation = resolve_activation(hidden_act).name
        self.local_intermediate = intermediate_size // self.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_intermediate, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_intermediate))
        for param, projections in ((self.w13_weight, ("gate", "up")), (self.w2_weight, ("down",))):
            param.weight_loader = self.weight_loader
            # checkpoint name relative to this module -> the weight_loader's shard id (loader.checkpoint_names)
            param.checkpoint_shards = {f"{e}.{p}_proj.weight": (e, p) for e in range(num_experts) for p in projections}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: tuple[int, str]) -> None:
        """One expert's gate, up ([I, H]) or down ([H, I]) projection into this rank's slice."""
        expert, projection = shard_id
        size = self.local_intermediate
        if projection == "down":
            copy_checked(param.data[expert], loaded.narrow(1, self.tp_rank * size, size), name)
        else:
            copy_checked(param.data[expert].narrow(0, _SHARD_ROWS[projection] * size, size),
                         loaded.narrow(0, self.tp_rank * size, size), name)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = kernels.moe_topk(router_logits, self.top_k, self.renormalize)
        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids, self.activation)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP where its config makes the layer sparse: the router (`gate`), the
    routed experts and, for Qwen2-MoE, a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str = "silu", shared_intermediate_size: int = 0):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = CustomGatedMLP(hidden_size, shared_intermediate_size, hidden_act)
            self.shared_expert.down_proj.reduce_results = False  # summed with the experts' partials first
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def projections(self) -> tuple:
        """The linear layers a decode step runs, in order (read-ahead chain)."""
        return (self.gate,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return distributed.all_reduce(out) if self.experts.tp_size > 1 else out

    def normed_forward(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
        """(this block of norm(x + residual), x + residual), as CustomGatedMLP.normed_forward."""
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual
