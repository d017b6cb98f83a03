"""kernels.sample with repetition, frequency and presence penalties (kernels.penalties): every
implementation draws from the penalized logits, reports their log-probabilities, and counts
each penalized row's drawn token in its table row."""
import functools

import pytest
import torch
from test_sampling import implementation, mixed_batch, replay
from test_sampling_bitmask import masked_logprobs, pack_bitmask

from nanovllm.kernels import dispatch, penalties, reference, sampling


def penalized_batch(vocab: int, device: str):
    """test_sampling.mixed_batch with table rows for rows 0, 2, 3, 6 and 7 (in another order),
    random counts and prompt tokens, and penalties of either sign."""
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(vocab, "cpu")
    rows = torch.tensor([3, -1, 0, 4, -1, -1, 1, 2, -1], dtype=torch.int32)
    counts = torch.randint(0, 3, (5, vocab), dtype=torch.int32) * (torch.rand(5, vocab) < 0.1)
    prompt = torch.rand(5, vocab) < 0.05
    presence = torch.tensor([0.5, 0, -0.3, 1.0, 0, 0, 2.0, 0.1, 0])
    frequency = torch.tensor([0.4, 0, 0.2, -0.5, 0, 0, 1.5, 0.3, 0])
    repetition = torch.tensor([1.3, 1, 0.8, 2.0, 1, 1, 1.1, 1.5, 1])
    given = penalties.Penalties(*(t.to(device) for t in (rows, presence, frequency, repetition, counts,
                                                          pack_bitmask(prompt))))
    return [t.to(device) for t in (x, temperatures, seeds, top_ks, top_ps, min_ps)], given, prompt


def penalized_float64(x, given: penalties.Penalties, prompt: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence / frequency formula and transformers' repetition penalty, in float64."""
    out = x.cpu().double().clone()
    for row, table_row in enumerate(given.rows.tolist()):
        if table_row < 0:
            continue
        counts = given.counts[table_row].cpu().double()
        seen = (counts > 0) | prompt[table_row]
        rep = given.repetition[row].item()
        out[row] = torch.where(seen, torch.where(out[row] > 0, out[row] / rep, out[row] * rep), out[row])
        out[row] -= given.frequency[row].item() * counts + given.presence[row].item() * (counts > 0)
    return out


def test_reference_penalties_follow_the_formulas():
    torch.manual_seed(0)
    (x, *_), given, prompt = penalized_batch(300, "cpu")
    torch.testing.assert_close(penalties.apply(x, given).double(), penalized_float64(x, given, prompt), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("target", [pytest.param("reference"),
                                    pytest.param("interpreter", marks=pytest.mark.triton_interpret),
                                    pytest.param("triton", marks=pytest.mark.gpu),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_kernel_draws_from_the_penalized_logits_and_counts_the_draw(target, vocab):
    """Top-k / top-p rows, min-p alone and no filter, with a bitmask on top: the replayed token
    of the penalized, masked logits, their log-probability, and the count of the drawn token
    one more in the penalized rows' table rows only. The CUDA C++ sampler hands these calls to
    the Triton kernels."""
    if target == "reference":
        device, sample = "cpu", reference.sample
    else:
        device, sample = implementation(target)
    if target == "cuda":
        sample = functools.partial(dispatch._sample_routed, sample, sampling.sample)
    torch.manual_seed(vocab + 2)
    (x, temperatures, seeds, top_ks, top_ps, min_ps), given, prompt = penalized_batch(vocab, device)
    allowed = torch.rand(x.shape) < 0.5
    allowed[:, vocab // 2] = True  # row 8's one finite logit
    bitmask = pack_bitmask(allowed).to(device)
    for filters, max_top_k in (((top_ks, top_ps, min_ps), 32), ((None, None, min_ps), None), ((None,) * 3, None)):
        before = given.counts.clone()
        expected = penalized_float64(x, given, prompt).masked_fill(~allowed, float("-inf"))
        tokens, logprobs = sample(x, temperatures, seeds, *filters, max_top_k, True, token_bitmask=bitmask,
                                  penalties=given)
        if target != "reference":  # the reference's own noise: its tokens are only allowed ones
            assert tokens.cpu().tolist() == replay(expected.float(), temperatures, seeds, *filters).tolist()
        assert allowed.gather(1, tokens.cpu()[:, None]).all()
        torch.testing.assert_close(logprobs.cpu().double(), masked_logprobs(expected, temperatures, allowed, tokens),
                                   atol=1e-4, rtol=1e-4)
        drawn = torch.zeros_like(before)
        for row, table_row in enumerate(given.rows.tolist()):
            if table_row >= 0:
                drawn[table_row, tokens[row]] += 1
        assert torch.equal(given.counts.cpu(), (before + drawn.to(device)).cpu())


@pytest.mark.parametrize("target", [pytest.param("interpreter", marks=pytest.mark.triton_interpret),
                                    pytest.param("triton", marks=pytest.mark.gpu)])
def test_sort_path_penalizes_and_counts(target):
    device, sample = implementation(target)
    torch.manual_seed(6)
    (x, temperatures, seeds, top_ks, top_ps, min_ps), given, prompt = penalized_batch(600, device)
    before = given.counts.clone()
    expected = penalized_float64(x, given, prompt)
    tokens, _ = sample(x, temperatures, seeds, top_ks, top_ps, min_ps, 600, False, penalties=given)
    assert tokens.cpu().tolist() == replay(expected.float(), temperatures, seeds, top_ks, top_ps, min_ps).tolist()
    assert (given.counts - before).sum().item() == (given.rows >= 0).sum().item()
