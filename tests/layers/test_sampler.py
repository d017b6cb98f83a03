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


def seeds(n, start=0):
    return torch.arange(start, start + n, dtype=torch.long)


def test_greedy_rows_take_the_argmax_and_others_sample():
    logits = torch.randn(4, 50)
    tokens = Sampler()(logits, torch.tensor([0.0, 1.0, 0.0, 1.0]), seeds(4))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 1000)
    row_seeds = seeds(6, start=100)
    alone = Sampler()(logits[2:3], torch.tensor([1.0]), row_seeds[2:3])
    batched = Sampler()(logits, torch.ones(6), row_seeds)
    shuffled = Sampler()(logits.flip(0), torch.ones(6), row_seeds.flip(0))
    assert alone[0] == batched[2] == shuffled[3]


def test_temperature_sampling_follows_the_softmax():
    """Chi-square test of 20,000 draws against softmax(logits / T); the threshold is the
    0.999 quantile of chi-square with 7 degrees of freedom (24.3)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, draws = 0.7, 20_000
    tokens = Sampler()(logits.repeat(draws, 1), torch.full((draws,), temperature), seeds(draws))
    observed = torch.bincount(tokens, minlength=8).double()
    expected = (logits / temperature).softmax(-1).double() * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 24.3, chi_square


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(500, 64)
    tokens = Sampler()(logits, torch.ones(500), seeds(500), torch.full((500,), 5), torch.ones(500))
    assert (logits.topk(5).indices == tokens[:, None]).any(dim=1).all()


def test_greedy_rows_with_filters_still_take_the_argmax():
    logits = torch.randn(3, 64)
    tokens = Sampler()(logits, torch.zeros(3), seeds(3), torch.full((3,), 10), torch.full((3,), 0.5))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_p_of_one_keeps_the_tail_whatever_the_batch():
    """fp32 cumulative sums reach 1.0 before the tail of a peaked distribution; a row that
    asked for no top-p filtering must keep every token even when another row filters."""
    peaked = torch.cat([torch.tensor([40.0]), torch.zeros(999)])
    logits = torch.stack([peaked, torch.randn(1000)])
    masked = apply_top_k_top_p(logits, torch.full((2,), 1000), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(masked[0]).all()
