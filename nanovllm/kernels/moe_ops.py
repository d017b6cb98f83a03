"""The public mixture-of-experts ops (kernels/moe.py): top-k routing, the alignment of
(token, k) slots to experts, and the experts' gated MLPs as grouped GEMMs."""
import torch

from nanovllm.kernels.checks import require, require_float, require_index, require_moe_operands
from nanovllm.kernels.dispatch import implementation

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # act_linear's names: silu, erf GELU, tanh GELU


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """A mixture-of-experts router's choice for each row of router_logits [T, E]: softmax over
    the experts, the top_k most probable (ties: the lowest expert id first), divided by their
    sum with `renormalize`. -> (float32 weights, int32 expert ids), [T, top_k] each."""
    require_float(router_logits, "router_logits")
    require(router_logits.dim() == 2 and router_logits.stride(1) == 1, "router_logits",
            lambda: f"must be [tokens, experts] with unit stride, got shape {tuple(router_logits.shape)}")
    require(isinstance(top_k, int) and 1 <= top_k <= router_logits.shape[1], "top_k",
            lambda: f"must be an int in [1, {router_logits.shape[1]}], got {top_k!r}")
    return implementation("moe_topk", router_logits.device)(router_logits, top_k, bool(renormalize))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The (token, k) slots of topk_ids [T, k] sorted by expert (slot order kept), each expert's
    run padded with T * k to a multiple of block_m, in a buffer sized for the worst case;
    and each block's expert, -1 past the last run. Shapes depend on T, k, num_experts and
    block_m only (CUDA-graph safe). -> (int32 sorted slots, int32 block experts)."""
    require_index(topk_ids, "topk_ids", 2)
    require(isinstance(num_experts, int) and num_experts >= 1, "num_experts", "must be a positive int")
    require(isinstance(block_m, int) and block_m >= 16 and block_m & (block_m - 1) == 0, "block_m",
            lambda: f"must be a power of two >= 16, got {block_m!r}")
    return implementation("moe_align", topk_ids.device)(topk_ids, num_experts, block_m)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer: for x [T, H], experts' gate above up
    w13 [E, 2I, H] and down w2 [E, H, I], sum_j topk_weights[t, j] * w2[e] act(gate) * up of
    expert e = topk_ids[t, j]. Ids must lie in [0, E): the kernels read the weights they name
    unchecked (moe_topk's are). Returns [T, H] in x's dtype."""
    require_moe_operands(x, w13, w2)
    require(activation in ACTIVATIONS, "activation",
            lambda: f"must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    require_index(topk_ids, "topk_ids", 2)
    require(topk_ids.shape[0] == x.shape[0], "topk_ids", "must have one row per token of x")
    require(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
            and topk_weights.shape == topk_ids.shape, "topk_weights",
            lambda: f"must be float32 of topk_ids' shape {tuple(topk_ids.shape)}")
    return implementation("fused_moe", x.device)(x, w13, w2, topk_weights.contiguous(), topk_ids.contiguous(),
                                                 activation)

