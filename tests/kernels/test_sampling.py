"""gumbel_sample on both backends: greedy rows exact, draws distributed as the softmax,
seeded rows independent of their batch, masked (-inf) tokens never drawn."""
import pytest
import torch
from kernel_testing import require_triton

from nanovllm.kernels import gumbel_sample

# (device, dtype): the PyTorch reference on the CPU, Triton through the interpreter, the GPU.
BACKENDS = [pytest.param("cpu", torch.float32, id="cpu-reference"),
            pytest.param("interpreter", torch.float32, id="interpreter", marks=pytest.mark.triton_interpret),
            pytest.param("cuda", torch.bfloat16, id="gpu", marks=pytest.mark.gpu)]


def device_of(target: str) -> str:
    if target == "interpreter":
        require_triton("cpu")
        return "cpu"
    if target == "cuda":
        require_triton("cuda")
    return target


@pytest.mark.parametrize("target,dtype", BACKENDS)
def test_greedy_rows_are_the_first_argmax(target, dtype):
    device = device_of(target)
    logits = torch.randn(5, 3001, device=device).to(dtype)
    logits[4, 10] = logits[4, 2000] = logits[4].max() + 1  # a tie: the first index wins
    tokens = gumbel_sample(logits, torch.zeros(5, device=device), torch.arange(5, device=device))
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, logits.float().argmax(-1)) and tokens[4] == 10


@pytest.mark.parametrize("target,dtype", BACKENDS)
def test_draws_follow_the_softmax(target, dtype):
    """Chi-square over 4,000 draws with 6 degrees of freedom; 22.5 is its 0.999 quantile.
    Token 3 is masked to -inf and must never come out."""
    device = device_of(target)
    base = torch.tensor([1.5, 0.5, 0.0, float("-inf"), -0.5, 1.0, 0.2, -1.0])
    draws, temperature = 4000, 0.8
    logits = base.repeat(draws, 1).to(device=device, dtype=dtype)
    tokens = gumbel_sample(logits, torch.full((draws,), temperature, device=device), torch.arange(draws, device=device))
    observed = torch.bincount(tokens.cpu(), minlength=8).double()
    assert observed[3] == 0
    probs = (base.to(dtype).float() / temperature).softmax(-1).double()
    keep = probs > 0
    expected = probs[keep] * draws
    chi_square = ((observed[keep] - expected) ** 2 / expected).sum().item()
    assert chi_square < 22.5, chi_square


@pytest.mark.parametrize("target,dtype", BACKENDS)
def test_a_row_depends_only_on_its_seed(target, dtype):
    device = device_of(target)
    logits = torch.randn(6, 2500, device=device).to(dtype)
    temperatures, seeds = torch.ones(6, device=device), torch.tensor([7, 8, 9, 10, 11, 12], device=device)
    batched = gumbel_sample(logits, temperatures, seeds)
    alone = gumbel_sample(logits[3:4], temperatures[3:4], seeds[3:4])
    flipped = gumbel_sample(logits.flip(0), temperatures, seeds.flip(0))
    assert alone[0] == batched[3] == flipped[2]
    other_seeds = gumbel_sample(logits, temperatures, seeds + 1000)
    assert not torch.equal(other_seeds, batched)  # 6 rows of 2,500 tokens: equal by chance ~never


def test_bad_arguments_name_the_argument():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="temperatures"):
        gumbel_sample(logits, torch.ones(2), torch.arange(3))
    with pytest.raises(ValueError, match="seeds"):
        gumbel_sample(logits, torch.ones(3), torch.ones(3))
