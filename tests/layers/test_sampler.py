import math

import torch

from nanovllm.layers.sampler import Sampler, apply_top_k_top_p


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(5, 97, dtype=torch.float32)
    top_ks = torch.tensor([1, 3, 10, 97, 50])
    masked = apply_top_k_top_p(logits, top_ks, torch.ones(5))
    for row, k in enumerate(top_ks.tolist()):
        kept = torch.isfinite(masked[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(masked[row, kept], logits[row, kept])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.5, 0.05, 0.3, 0.15], [0.5, 0.05, 0.3, 0.15]]))
    masked = apply_top_k_top_p(logits, torch.full((3,), 4), torch.tensor([0.5, 0.8, 0.81]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False],
                                               [True, False, True, False],
                                               [True, False, True, True]]


def test_greedy_rows_take_the_argmax_and_others_sample():
    logits = torch.randn(4, 50)
    tokens = Sampler()(logits.clone(), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 1000)
    alone = Sampler()(logits[2:3].clone(), torch.tensor([1.0]), generators={0: torch.Generator().manual_seed(7)})
    batched = Sampler()(logits.clone(), torch.ones(6), generators={2: torch.Generator().manual_seed(7)})
    assert alone[0] == batched[2]
    again = [Sampler()(logits[2:3].clone(), torch.tensor([1.0]), generators={0: torch.Generator().manual_seed(7)})[0]
             for _ in range(3)]
    assert all(t == alone[0] for t in again)


def test_temperature_sampling_follows_the_softmax():
    """Chi-square test of 40,000 draws against softmax(logits / T); the threshold is the
    0.999 quantile of chi-square with 7 degrees of freedom (24.3)."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, draws = 0.7, 40_000
    tokens = Sampler()(logits.repeat(draws, 1), torch.full((draws,), temperature))
    observed = torch.bincount(tokens, minlength=8).double()
    expected = (logits / temperature).softmax(-1).double() * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 24.3, chi_square


def test_top_k_sampling_never_leaves_the_top_k():
    torch.manual_seed(1)
    logits = torch.randn(2000, 64)
    tokens = Sampler()(logits.clone(), torch.ones(2000), torch.full((2000,), 5), torch.ones(2000))
    top5 = logits.topk(5).indices
    assert (top5 == tokens[:, None]).any(dim=1).all()
    assert not math.isnan(tokens.float().mean().item())


def test_greedy_row_hints_give_the_same_tokens():
    logits = torch.randn(5, 300)
    temperatures = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(Sampler()(logits.clone(), temperatures, greedy_rows="all"), logits.argmax(-1))
    assert torch.equal(Sampler()(logits.clone(), temperatures, greedy_rows="some"), logits.argmax(-1))
    hot = torch.full((5,), 1e-4)  # near-zero temperature: sampling collapses onto the argmax
    assert torch.equal(Sampler()(logits.clone(), hot, greedy_rows="none"), logits.argmax(-1))
