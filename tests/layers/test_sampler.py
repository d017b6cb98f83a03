"""The sampler layer on the CPU (the kernels' own tests: tests/kernels/test_sampling.py)."""
import torch

from nanovllm.layers.sampler import Sampler, top_logprobs


def seeds(n, start=0):
    return torch.arange(start, start + n, dtype=torch.long)


def test_greedy_rows_take_the_argmax_and_others_sample():
    logits = torch.randn(4, 50)
    tokens, _ = Sampler()(logits, torch.tensor([0.0, 1.0, 0.0, 1.0]), seeds(4))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 1000)
    row_seeds = seeds(6, start=100)
    alone, _ = Sampler()(logits[2:3], torch.tensor([1.0]), row_seeds[2:3])
    batched, _ = Sampler()(logits, torch.ones(6), row_seeds)
    shuffled, _ = Sampler()(logits.flip(0), torch.ones(6), row_seeds.flip(0))
    assert alone[0] == batched[2] == shuffled[3]


def test_filters_reach_the_kernel():
    logits = torch.randn(500, 64)
    tokens, _ = Sampler()(logits, torch.ones(500), seeds(500), torch.full((500,), 5), torch.ones(500), max_top_k=5)
    assert (logits.topk(5).indices == tokens[:, None]).any(dim=1).all()
    min_p, _ = Sampler()(logits, torch.ones(500), seeds(500), min_ps=torch.ones(500))  # only the max survives
    assert torch.equal(min_p, logits.argmax(-1))


def test_a_top_p_that_rounds_to_zero_in_float32_takes_the_argmax():
    logits = torch.randn(3, 64)
    tokens, _ = Sampler()(logits, torch.ones(3), seeds(3), top_ps=torch.tensor([1e-50, 0.0, 1e-45]))
    assert torch.equal(tokens, logits.argmax(-1))


def test_greedy_rows_with_filters_still_take_the_argmax():
    logits = torch.randn(3, 64)
    tokens, _ = Sampler()(logits, torch.zeros(3), seeds(3), torch.full((3,), 10), torch.full((3,), 0.5))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_logprobs_are_the_largest_log_softmax_entries():
    logits = torch.randn(3, 40)
    temperatures = torch.tensor([0.0, 0.5, 2.0])
    values, ids = top_logprobs(logits, temperatures, 4)
    scale = torch.tensor([1.0, 0.5, 2.0])[:, None]
    full = (logits / scale).log_softmax(-1)
    assert torch.equal(ids, full.argsort(dim=-1, descending=True)[:, :4])
    torch.testing.assert_close(values, full.gather(1, ids))


def test_logprobs_of_every_row_and_top_logprobs_of_the_rows_asked():
    """fp32 logits: the chosen tokens' log-probabilities within 1e-5 of a float64 log_softmax."""
    logits = torch.randn(5, 70)
    temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 2.0])
    tokens, (chosen, (values, ids)) = Sampler()(logits, temperatures, seeds(5), logprobs=True,
                                                top_rows=torch.tensor([1, 3]), num_top=6)
    scale = torch.where(temperatures > 0, temperatures, 1).double()[:, None]
    full = (logits.double() / scale).log_softmax(-1)
    torch.testing.assert_close(chosen.double(), full.gather(1, tokens[:, None]).view(-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(ids, full[[1, 3]].topk(6).indices)
    torch.testing.assert_close(values.double(), full[[1, 3]].topk(6).values, atol=1e-5, rtol=1e-5)
    assert Sampler()(logits, temperatures, seeds(5))[1] is None
    assert Sampler()(logits, temperatures, seeds(5), logprobs=True)[1][1] is None
