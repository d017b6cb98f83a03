"""The mixture-of-experts kernels against their float64 references: routing (ties to the lowest
expert id), the alignment's sorted slots and block experts, and the grouped GEMMs at odd sizes,
with experts that get no token, every token on one expert and more experts than tokens."""
import pytest
import torch
from kernel_testing import (FP32_INTERPRETER_AND_GPU, TARGETS, assert_close, capture_and_replay, poison_allocator,
                            randn, require_triton)

from nanovllm import kernels
from nanovllm.kernels import reference


def _valid_rows(block_experts: torch.Tensor, block_m: int) -> int:
    return int((block_experts >= 0).sum()) * block_m


def _assert_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_slots, block_experts = kernels.moe_align(topk_ids, num_experts, block_m)
    expected_slots, expected_experts = reference.moe_align(topk_ids.cpu(), num_experts, block_m)
    assert sorted_slots.shape == expected_slots.shape and block_experts.shape == expected_experts.shape
    assert torch.equal(block_experts.cpu(), expected_experts)
    rows = _valid_rows(expected_experts, block_m)
    assert torch.equal(sorted_slots.cpu()[:rows], expected_slots[:rows])


def _moe_weights(num_experts: int, hidden: int, intermediate: int, dtype, device):
    w13 = randn(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device) / hidden ** 0.5
    w2 = randn(num_experts, hidden, intermediate, dtype=dtype, device=device) / intermediate ** 0.5
    return w13, w2


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 8, 2, True), (37, 12, 3, False), (5, 3, 3, True)])
def test_topk_matches_float64(device, dtype, tokens, experts, top_k, renormalize):
    require_triton(device)
    logits = randn(tokens, experts + 5, dtype=dtype, device=device)[:, 2:2 + experts]  # strided rows
    weights, ids = kernels.moe_topk(logits, top_k, renormalize)
    expected_weights, expected_ids = reference.moe_topk(logits.double(), top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights.double(), expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_topk_ties_pick_the_lowest_expert(device, dtype):
    """Equal logits (equal probabilities) rank by expert id; torch.topk leaves their order open."""
    require_triton(device)
    logits = torch.zeros(3, 16, dtype=dtype, device=device)
    logits[1, [3, 9, 12]] = 1.0
    logits[2, 7] = 2.0
    weights, ids = kernels.moe_topk(logits, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 12, 0], [7, 0, 1, 2]]
    assert torch.equal(ids, reference.moe_topk(logits, 4, True)[1])
    assert torch.allclose(weights[0], torch.full((4,), 0.25, device=device))


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
@pytest.mark.parametrize("case", ["spread", "one_expert", "few_tokens", "several_chunks"])
def test_align_matches_reference(device, dtype, case, monkeypatch):
    require_triton(device)
    generator = torch.Generator().manual_seed(0)
    if case == "spread":  # experts 5..7 get nothing
        topk_ids, experts = torch.randint(0, 5, (19, 2), generator=generator), 8
    elif case == "one_expert":
        topk_ids, experts = torch.full((33, 1), 6), 7
    elif case == "few_tokens":  # a decode step: 2 of 64 experts
        topk_ids, experts = torch.tensor([[40, 3]]), 64
    else:  # slots in five programs' chunks (short chunks: the interpreter sorts slowly)
        from nanovllm.kernels import moe
        monkeypatch.setattr(moe, "_ALIGN_CHUNK", 32)
        topk_ids, experts = torch.randint(0, 10, (50, 3), generator=generator), 10
    for block_m in (16, 64):
        _assert_alignment(topk_ids.to(device=device, dtype=torch.int32), experts, block_m)


@pytest.mark.parametrize("device,dtype", TARGETS)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,intermediate",
                         [(1, 8, 2, 64, 48), (37, 12, 3, 96, 40), (5, 3, 3, 80, 72)])
def test_fused_moe_matches_float64(device, dtype, tokens, experts, top_k, hidden, intermediate):
    require_triton(device)
    x = randn(tokens, hidden, dtype=dtype, device=device)
    w13, w2 = _moe_weights(experts, hidden, intermediate, dtype, device)
    weights, ids = kernels.moe_topk(randn(tokens, experts, dtype=torch.float32, device=device), top_k, True)
    poison_allocator(tokens * top_k * max(hidden, intermediate) * 4, device)
    out = kernels.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, reference.fused_moe(x.double(), w13.double(), w2.double(), weights, ids), dtype)


@pytest.mark.parametrize("device,dtype", FP32_INTERPRETER_AND_GPU)
def test_fused_moe_all_tokens_on_one_expert(device, dtype):
    """One expert's run spans several row blocks; the other experts' weights are never read
    (NaN there would show)."""
    require_triton(device)
    tokens, hidden, intermediate = 40, 64, 32
    x = randn(tokens, hidden, dtype=dtype, device=device)
    w13, w2 = _moe_weights(4, hidden, intermediate, dtype, device)
    w13[[0, 1, 3]] = float("nan")
    w2[[0, 1, 3]] = float("nan")
    ids = torch.full((tokens, 1), 2, dtype=torch.int32, device=device)
    weights = torch.rand(tokens, 1, device=device)
    out = kernels.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, reference.fused_moe(x.double(), w13.double(), w2.double(), weights, ids), dtype)


def test_arguments_are_checked():
    x, w13, w2 = torch.zeros(2, 8), torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    ids, weights = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_topk(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="block_m"):
        kernels.moe_align(ids, 4, 24)
    with pytest.raises(ValueError, match="w2"):
        kernels.fused_moe(x, w13, torch.zeros(4, 8, 4), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        kernels.fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        kernels.fused_moe(x, w13, w2, weights, ids[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_moe_layer_replays_in_a_cuda_graph(tokens):
    """Routing, alignment and both GEMMs read no tensor on the host: a captured layer replays."""
    torch.manual_seed(0)
    x = torch.randn(tokens, 256, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(tokens, 32, dtype=torch.bfloat16, device="cuda")
    w13, w2 = _moe_weights(32, 256, 96, torch.bfloat16, "cuda")

    def layer():
        weights, ids = kernels.moe_topk(logits, 4, True)
        return kernels.fused_moe(x, w13, w2, weights, ids)

    expected = layer()
    assert torch.equal(capture_and_replay(layer), expected)
    weights, ids = reference.moe_topk(logits, 4, True)
    assert_close(expected, reference.fused_moe(x.double(), w13.double(), w2.double(), weights, ids), torch.bfloat16)
