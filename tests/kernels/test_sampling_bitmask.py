"""kernels.sample with an allowed-token bitmask (int32 [B, ceil(V / 32)], bit v % 32 of word
v // 32 allows token v): every implementation draws as if the disallowed tokens were -inf
logits, for every kind of row, and its log-probabilities are those of the masked distribution."""
import functools

import pytest
import torch
from test_sampling import implementation, mixed_batch, replay

from nanovllm import kernels
from nanovllm.kernels import dispatch, reference, sampling
from nanovllm.layers.sampler import Sampler


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, ceil(V / 32)], token v at bit v % 32 of word v // 32."""
    rows, vocab = allowed.shape
    bits = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def masked_batch(vocab: int, device: str):
    """test_sampling.mixed_batch with a bitmask: the greedy row loses its argmax, row 1 is
    unconstrained (all ones), row 3 keeps one of its four tied maxima and a few others, row 5
    (tiny top_p) allows one token, row 8 its one finite logit and -inf ones; the rest keep
    about a third of the vocabulary."""
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(vocab, "cpu")
    allowed = torch.rand(x.shape) < 0.33
    allowed[0, x[0].argmax()] = False
    allowed[1] = True
    allowed[3, :4] = torch.tensor([False, True, False, False])
    allowed[5] = False
    allowed[5, vocab - 1] = True
    allowed[8, vocab // 2] = True
    bitmask = pack_bitmask(allowed)
    return [t.to(device) for t in (x, temperatures, seeds, top_ks, top_ps, min_ps, bitmask)], allowed


def masked_logprobs(x, temperatures, allowed, tokens) -> torch.Tensor:
    """float64 log_softmax(masked x / T)[token], T = 1 for greedy rows."""
    scale = torch.where(temperatures > 0, temperatures, 1).cpu().double()[:, None]
    masked = x.cpu().double().masked_fill(~allowed, float("-inf"))
    return (masked / scale).log_softmax(-1).gather(1, tokens.cpu()[:, None]).view(-1)


def test_the_bitmask_layout_is_xgrammars():
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[0, [0, 2, 31, 32]] = True
    allowed[1, 33:] = True
    bitmask = pack_bitmask(allowed)
    assert bitmask.tolist() == [[5 | -2**31, 1], [0, 254]]
    assert torch.equal(reference.allowed_tokens(bitmask, 40), allowed)
    xgrammar = pytest.importorskip("xgrammar")
    logits = torch.zeros(2, 40)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(reference.apply_token_bitmask(torch.zeros(2, 40), bitmask), logits)


def test_reference_draws_only_allowed_tokens_with_masked_logprobs():
    torch.manual_seed(0)
    (x, temperatures, seeds, top_ks, top_ps, min_ps, bitmask), allowed = masked_batch(300, "cpu")
    for filters in ((top_ks, top_ps, min_ps), (None, None, None)):
        tokens, logprobs = reference.sample(x, temperatures, seeds, *filters, logprobs=True, token_bitmask=bitmask)
        assert allowed.gather(1, tokens[:, None]).all()
        torch.testing.assert_close(logprobs.double(), masked_logprobs(x, temperatures, allowed, tokens))
    assert tokens[0] == x[0].masked_fill(~allowed[0], float("-inf")).argmax()
    assert tokens[5] == 299


@pytest.mark.parametrize("target", [pytest.param("interpreter", marks=pytest.mark.triton_interpret),
                                    pytest.param("triton", marks=pytest.mark.gpu),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_kernel_draws_the_replayed_token_of_the_masked_logits(target, vocab):
    """Every kind of row, with top-k / top-p (max_top_k 32), min-p alone, and no filter: the
    token the kernels' noise draws from the masked logits, and its masked log-probability.
    The CUDA C++ sampler's calls with a bitmask go to the Triton kernels (dispatch.py)."""
    device, sample = implementation(target)
    if target == "cuda":
        sample = functools.partial(dispatch._sample_routed, sample, sampling.sample)
    torch.manual_seed(vocab + 1)
    (x, temperatures, seeds, top_ks, top_ps, min_ps, bitmask), allowed = masked_batch(vocab, device)
    masked = x.masked_fill(~allowed.to(device), float("-inf"))
    for filters, max_top_k in (((top_ks, top_ps, min_ps), 32), ((None, None, min_ps), None), ((None,) * 3, None)):
        tokens, logprobs = sample(x, temperatures, seeds, *filters, max_top_k, True, token_bitmask=bitmask)
        assert tokens.cpu().tolist() == replay(masked, temperatures, seeds, *filters).tolist()
        torch.testing.assert_close(logprobs.cpu().double(), masked_logprobs(x, temperatures, allowed, tokens),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", [pytest.param("interpreter", marks=pytest.mark.triton_interpret),
                                    pytest.param("triton", marks=pytest.mark.gpu)])
def test_sort_path_draws_from_the_masked_logits(target):
    """Past SORT_FREE_TOP_K candidates the filters come from a sort of the masked logits."""
    device, sample = implementation(target)
    torch.manual_seed(4)
    (x, temperatures, seeds, top_ks, top_ps, min_ps, bitmask), allowed = masked_batch(600, device)
    masked = x.masked_fill(~allowed.to(device), float("-inf"))
    tokens, logprobs = sample(x, temperatures, seeds, top_ks, top_ps, min_ps, 600, True, token_bitmask=bitmask)
    assert tokens.cpu().tolist() == replay(masked, temperatures, seeds, top_ks, top_ps, min_ps).tolist()
    torch.testing.assert_close(logprobs.cpu().double(), masked_logprobs(x, temperatures, allowed, tokens),
                               atol=1e-4, rtol=1e-4)


def test_a_bad_bitmask_is_named():
    logits = torch.randn(3, 70)
    args = (logits, torch.ones(3), torch.arange(3))
    with pytest.raises(ValueError, match=r"token_bitmask: must be int32 of shape \(3, 3\)"):
        kernels.sample(*args, token_bitmask=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_bitmask: must be int32"):
        kernels.sample(*args, token_bitmask=torch.zeros(3, 3, dtype=torch.int64))


def test_the_cuda_sampler_hands_masked_calls_to_triton():
    calls = []
    cuda = lambda *args: calls.append(("cuda", len(args)))  # noqa: E731
    triton = lambda *args, token_bitmask, penalties: calls.append(("triton", len(args), token_bitmask))  # noqa: E731
    dispatch._sample_routed(cuda, triton, *range(8))
    dispatch._sample_routed(cuda, triton, *range(8), token_bitmask="mask")
    assert calls == [("cuda", 8), ("triton", 8, "mask")]


def test_the_sampler_layer_masks_the_draw_and_the_top_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(4, 100)
    temperatures = torch.tensor([0.0, 0.8, 1.0, 0.0])
    allowed = torch.rand(4, 100) < 0.2
    allowed[:, 7] = True
    tokens, (chosen, (values, ids)) = Sampler()(logits, temperatures, torch.arange(4), logprobs=True,
                                                top_rows=torch.tensor([0, 2]), num_top=5,
                                                token_bitmask=pack_bitmask(allowed))
    assert allowed.gather(1, tokens[:, None]).all()
    scale = torch.where(temperatures > 0, temperatures, 1).double()[:, None]
    full = (logits.double().masked_fill(~allowed, float("-inf")) / scale).log_softmax(-1)
    assert torch.equal(ids, full[[0, 2]].topk(5).indices)
    torch.testing.assert_close(values.double(), full[[0, 2]].topk(5).values)
    torch.testing.assert_close(chosen.double(), full.gather(1, tokens[:, None]).view(-1))
