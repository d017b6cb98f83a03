"""kernels.sample on every implementation.

The PyTorch reference is checked against exact filtered distributions computed here from the
definition (chi-square over many draws of a small vocabulary). The kernels' noise is a known
function of (seed, token): `replay` recomputes it in NumPy, so the Triton kernel (through the
interpreter) and the CUDA C++ one (on a GPU) are checked token for token against the
reference's filter on fresh random logits, and the noise itself against the softmax."""
import fcntl
import math
import os
import warnings

import numpy as np
import pytest
import torch
from kernel_testing import require_triton

from nanovllm import kernels
from nanovllm.kernels import cuda, dispatch, reference, sampling

# chi-square 0.999 quantiles by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def exact_probs(logits, temperature, top_k=None, top_p=None, min_p=None) -> list[float]:
    """The filtered distribution, from the definition in float64: rank by (logit desc, id asc);
    min-p and top-k keep ranks; top-p keeps the ranks before which less than top_p of the
    remaining mass lies."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    top = logits[order[0]]
    weight = {i: math.exp((logits[i] - top) / temperature) for i in order if logits[i] > -math.inf}
    kept = [i for rank, i in enumerate(order) if i in weight and (top_k is None or rank < top_k)
            and (min_p is None or weight[i] >= min_p)]
    if top_p is not None and top_p < 1:
        total, before, within = sum(weight[i] for i in kept), 0.0, []
        for i in kept:
            if before < top_p * total:
                within.append(i)
            before += weight[i]
        kept = within
    mass = sum(weight[i] for i in kept)
    return [weight[i] / mass if i in kept else 0.0 for i in range(len(logits))]


def chi_square(tokens: torch.Tensor, probs: list[float]) -> tuple[float, int, int]:
    """-> (statistic, degrees of freedom, draws of tokens of probability 0)."""
    observed = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    draws = observed.sum().item()
    support = [i for i, p in enumerate(probs) if p > 0]
    statistic = sum((observed[i].item() - probs[i] * draws) ** 2 / (probs[i] * draws) for i in support)
    outside = int(sum(observed[i].item() for i, p in enumerate(probs) if p == 0))
    return statistic, len(support) - 1, outside


BASE = [1.5, 0.5, 0.0, -math.inf, -0.5, 1.0, 0.2, -1.0, 1.0, 0.3]
CASES = {  # name: (logits, T, top_k, top_p, min_p)
    "temperature": (BASE, 0.8, None, None, None),
    "top_k=1": (BASE, 0.8, 1, None, None),
    "top_k=3 tie at the boundary": (BASE, 0.8, 3, None, None),  # ids 5 and 8 tie at the third rank
    "tiny top_p": (BASE, 0.8, None, 1e-6, None),
    "top_p=0.7": (BASE, 0.8, None, 0.7, None),
    "top_k=5 top_p=0.8": (BASE, 1.3, 5, 0.8, None),
    "min_p=0": (BASE, 0.8, None, None, 0.0),
    "min_p=0.3": (BASE, 0.8, None, None, 0.3),
    "min_p=1": (BASE, 0.8, None, None, 1.0),  # only the max survives
    "all -inf but one": ([-math.inf] * 4 + [0.3] + [-math.inf] * 5, 1.0, 3, 0.9, 0.1),
    "everything": (BASE, 0.6, 4, 0.95, 0.2),
}


def batch_of(case, draws: int, device="cpu", first_seed: int = 0):
    logits, temperature, top_k, top_p, min_p = case
    full = lambda value, dtype=torch.float32: None if value is None else torch.full((draws,), value, dtype=dtype,  # noqa: E731
                                                                                      device=device)
    return (torch.tensor(logits, device=device).repeat(draws, 1), full(temperature),
            torch.arange(first_seed, first_seed + draws, device=device),
            full(top_k, torch.long), full(top_p), full(min_p))


@pytest.mark.parametrize("name", list(CASES))
def test_reference_draws_follow_the_filtered_distribution(name):
    """6,000 draws a case, each case its own seeds; the threshold is chi-square's 0.999 quantile."""
    logits, temperature, top_k, top_p, min_p = CASES[name]
    x, temperatures, seeds, top_ks, top_ps, min_ps = batch_of(CASES[name], 6000, first_seed=list(CASES).index(name) << 20)
    tokens, _ = reference.sample(x, temperatures, seeds, top_ks, top_ps, min_ps)
    statistic, dof, outside = chi_square(tokens, exact_probs(logits, temperature, top_k, top_p, min_p))
    assert outside == 0
    assert dof == 0 or statistic < CHI2_999[dof], statistic


def test_reference_tie_at_the_top_k_boundary_keeps_the_lower_id():
    mask = reference.sampling_mask(torch.tensor([[2.0, 1.0, 3.0, 1.0, 1.0]]), torch.ones(1), torch.tensor([3]))
    assert mask.tolist() == [[True, True, True, False, False]]


def test_reference_greedy_rows_ignore_filters_and_logprobs_are_log_softmax():
    x = torch.randn(4, 50)
    temperatures = torch.tensor([0.0, 0.7, 0.0, 1.3])
    tokens, logprobs = reference.sample(x, temperatures, torch.arange(4), torch.full((4,), 2),
                                        torch.full((4,), 0.5), torch.full((4,), 0.1), logprobs=True)
    assert tokens[0] == x[0].argmax() and tokens[2] == x[2].argmax()
    scale = torch.tensor([1.0, 0.7, 1.0, 1.3])[:, None]
    expected = (x / scale).log_softmax(-1).gather(1, tokens[:, None]).view(-1)
    torch.testing.assert_close(logprobs, expected)


# ---- the kernels' noise, replayed in NumPy ----

def philox(seed: int, counters: np.ndarray, rounds: int = sampling.PHILOX_ROUNDS):
    """Triton's randint4x(seed, counters) for int32 counters."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = counters.astype(np.uint64), *(np.zeros(counters.shape, np.uint64),) * 3
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        p0, p2 = c0, c2
        c0, c2 = ((b * p2) >> np.uint64(32)) ^ c1 ^ k0, ((a * p0) >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = (b * p2) & mask, (a * p0) & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


def noise(seed: int, vocab: int) -> np.ndarray:
    """float32 [vocab]: -log2(-log2(u)) of every token, as the kernels draw it."""
    n = sampling.noise_block(vocab)
    tokens = np.arange(vocab)
    parts = philox(seed, tokens - tokens % (4 * n) + tokens % n)
    bits = np.choose((tokens % (4 * n)) // n, parts).astype(np.uint32).view(np.int32)
    u = np.where(bits < 0, ~bits, bits).astype(np.float32) * np.float32(4.6566127342e-10)
    u = np.minimum(u, np.float32(sampling.U_MAX))
    return -np.log2(-np.log2(u))


def replay(x, temperatures, seeds, top_ks=None, top_ps=None, min_ps=None) -> torch.Tensor:
    """The tokens the kernels must draw: the reference's filter, the kernels' noise."""
    x = x.float().cpu()
    pick = lambda t: None if t is None else t.cpu()  # noqa: E731
    keep = reference.sampling_mask(x, temperatures.cpu(), pick(top_ks), pick(top_ps), pick(min_ps))
    tokens = x.argmax(-1)
    for row, (temperature, seed) in enumerate(zip(temperatures.tolist(), seeds.tolist())):
        if temperature > 0:
            scale = np.float32(sampling.LOG2E) / np.float32(temperature)
            noisy = x[row].numpy() * scale + noise(seed, x.shape[1])
            tokens[row] = int(np.argmax(np.where(keep[row].numpy(), noisy, -np.inf)))
    return tokens


def test_the_kernels_noise_draws_the_softmax():
    """The replayed noise alone (Philox, 7 rounds, base-2 Gumbel) over 20,000 seeds."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    temperature, draws = 0.7, 20_000
    scale = np.float32(sampling.LOG2E / temperature)
    tokens = torch.tensor([int(np.argmax(logits * scale + noise(seed, 8))) for seed in range(draws)])
    probs = torch.tensor(logits / temperature, dtype=torch.float64).softmax(-1).tolist()
    statistic, dof, _ = chi_square(tokens, probs)
    assert statistic < CHI2_999[dof], statistic


# ---- the kernels ----

def mixed_batch(vocab: int, device: str, dtype=torch.float32):
    """Rows of every kind: greedy, plain, top-k with a tie at the boundary, top-p, min-p alone,
    all filters, one finite logit. Returns (logits, temperatures, seeds, top_ks, top_ps, min_ps)."""
    x = torch.randn(9, vocab).mul_(2)
    x[2, 7] = x[2, 9] = x[2].max() + 1  # a tie between the 1st and 2nd ranks
    x[3, :4] = x[3].max() + 0.5  # four tied maxima with top_k = 2
    x[8] = float("-inf")
    x[8, vocab // 2] = 0.0
    temperatures = torch.tensor([0.0, 0.8, 1.0, 0.7, 0.6, 1.2, 0.9, 0.6, 1.0])
    top_ks = torch.tensor([5, -1, 1, 2, 20, -1, -1, 8, 3])
    top_ps = torch.tensor([0.5, 1.0, 1.0, 1.0, 0.9, 1e-6, 1.0, 0.95, 0.9])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.05, 0.1])
    seeds = torch.arange(100, 109)
    return [t.to(device) for t in (x.to(dtype), temperatures, seeds, top_ks, top_ps, min_ps)]


def kernel_targets():
    return [pytest.param("interpreter", marks=pytest.mark.triton_interpret),
            pytest.param("triton", marks=pytest.mark.gpu), pytest.param("cuda", marks=pytest.mark.gpu)]


def implementation(target: str):
    if target == "interpreter":
        require_triton("cpu")
        return "cpu", sampling.sample
    require_triton("cuda")
    if target == "triton":
        return "cuda", sampling.sample
    from nanovllm.kernels.cuda import sampling as cuda_sampling
    sample = cuda_sampling.sampler()
    assert sample is not None, "the CUDA C++ sampler did not build (see the warning)"
    return "cuda", sample


@pytest.mark.parametrize("target", kernel_targets())
@pytest.mark.parametrize("vocab", [300, 5000])
def test_kernel_draws_the_replayed_token_in_every_kind_of_row(target, vocab):
    """5,000 tokens: two scan chunks, 157 groups. A row filtered by top-k or top-p holds
    max_top_k = 32 candidates."""
    device, sample = implementation(target)
    torch.manual_seed(vocab)
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(vocab, device)
    top_ps[5] = 1e-6
    tokens, logprobs = sample(x, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=32, logprobs=True)
    expected = replay(x, temperatures, seeds, top_ks, top_ps, min_ps)
    assert tokens.dtype == torch.int64
    assert tokens.cpu().tolist() == expected.tolist()
    scale = torch.where(temperatures > 0, temperatures, 1).cpu()[:, None]
    reference_logprobs = (x.cpu().double() / scale).log_softmax(-1).gather(1, tokens.cpu()[:, None]).view(-1)
    torch.testing.assert_close(logprobs.cpu().double(), reference_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", kernel_targets())
def test_kernel_without_filters_and_with_min_p_alone(target):
    device, sample = implementation(target)
    torch.manual_seed(1)
    x, temperatures, seeds, _, _, min_ps = mixed_batch(700, device)
    tokens, none = sample(x, temperatures, seeds)
    assert none is None
    assert tokens.cpu().tolist() == replay(x, temperatures, seeds).tolist()
    tokens, _ = sample(x, temperatures, seeds, min_ps=min_ps)
    assert tokens.cpu().tolist() == replay(x, temperatures, seeds, min_ps=min_ps).tolist()


@pytest.mark.parametrize("target", kernel_targets())
def test_a_seeded_row_does_not_depend_on_its_batch(target):
    device, sample = implementation(target)
    torch.manual_seed(2)
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(400, device)
    batched, _ = sample(x, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=20)
    for row in (1, 4, 7):
        alone, _ = sample(x[row:row + 1], temperatures[row:row + 1], seeds[row:row + 1], top_ks[row:row + 1],
                          top_ps[row:row + 1], min_ps[row:row + 1], max_top_k=20)
        assert alone.item() == batched[row].item()
    flipped, _ = sample(x.flip(0), temperatures.flip(0), seeds.flip(0), top_ks.flip(0), top_ps.flip(0),
                        min_ps.flip(0), max_top_k=20)
    assert flipped.flip(0).tolist() == batched.tolist()
    other, _ = sample(x, temperatures, seeds + 1000, top_ks, top_ps, min_ps, max_top_k=20)
    assert other.tolist() != batched.tolist()  # rows 1 and 6 draw from hundreds of tokens


def selection_batch(vocab: int):
    """Rows whose group selection is hard, for max_top_k = 16: ties at the k-th group maximum,
    -inf groups, k above the finite groups, k equal to the groups (16 or fewer), top-p alone
    (k = 16, past 11 groups), -0.0 and 0.0, negative and positive maxima, all groups tied, few
    distinct values. Returns (logits, top_ks, top_ps)."""
    groups = -(-vocab // sampling.GROUP)
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen).mul_(0.5).sub_(6)  # every logit below -3
    for g in range(groups):  # a 1.0 in every third group, a 2.0 in every fifth of the first 40
        if g % 3 == 1:
            x[0, min(g * sampling.GROUP + 7 * g % sampling.GROUP, vocab - 1)] = 1.0
        if g % 5 == 2 and g < 40:
            x[0, g * sampling.GROUP] = 2.0
    x[1] = float("-inf")
    x[1, [5, vocab // 2, vocab - 1]] = torch.tensor([2.0, -1.0, 0.5])  # the last group is partial
    x[4, [1, 2, 6 * sampling.GROUP]] = 3.0  # the top 3 tokens lie in 2 groups; the third chosen:
    x[4, 7 * sampling.GROUP + 9] = 0.0  # this one, as the keys rank -0.0 below 0.0,
    x[4, 2 * sampling.GROUP + 3] = -0.0  # not this one of lower id
    x[5].normal_(generator=gen).mul_(2)
    x[6].normal_(generator=gen)
    x[7] = 0.25
    x[8] = torch.randint(-2, 3, (vocab,), generator=gen).float()
    top_ks = torch.tensor([2 + len(range(2, min(groups, 40), 5)), 10, min(groups, 16), -1, 3, 1, 16, 5, 7])
    top_ps = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 0.8])
    return x, top_ks, top_ps


def top_groups(x: torch.Tensor, k: int) -> list[int]:
    """The ids, increasing, of the min(k, groups) groups first by (max desc, -0.0 below 0.0, id
    asc), then the padding ids up to min(k, groups rounded up to a power of two)."""
    groups = -(-x.numel() // sampling.GROUP)
    maxima = torch.full((groups * sampling.GROUP,), float("-inf")).index_copy(
        0, torch.arange(x.numel()), x).view(groups, -1).amax(1).tolist()
    order = sorted(range(groups), key=lambda g: (-maxima[g], math.copysign(1, maxima[g]) < 0, g))
    count = min(k, 1 << (groups - 1).bit_length())
    return sorted(order[:k]) + list(range(groups, count))


class KeepingBuffers(sampling.SampleLaunches):
    def finalize(self, logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad):
        super().finalize(logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad)
        self.buffers = buffers


@pytest.mark.parametrize("target", kernel_targets()[:2])
@pytest.mark.parametrize("vocab, select", [(333, sampling.SELECT), (4001, sampling.SELECT), (4001, 64)])
def test_group_selection_takes_the_first_groups_by_max_then_id(target, vocab, select, monkeypatch):
    """The group ids the finalize writes, against their definition: one select over 11 or 126
    groups and, past SELECT = 64, one over tiles of 4 groups first; the tokens drawn from them
    as replayed."""
    monkeypatch.setattr(sampling, "SELECT", select)
    device, _ = implementation(target)
    x, top_ks, top_ps = selection_batch(vocab)
    temperatures, seeds = torch.full((9,), 0.8), torch.arange(9) + 40
    launches = KeepingBuffers()
    tokens, _ = sampling.sample(*(t.to(device) for t in (x, temperatures, seeds, top_ks, top_ps)),
                                max_top_k=16, launches=launches)
    bounded = torch.where(top_ks > 0, top_ks, 16)  # top-p alone keeps max_top_k = 16 tokens at most
    gids = launches.buffers["gids"].cpu()
    for row, k in enumerate(bounded.tolist()):
        expected = top_groups(x[row], k)
        assert gids[row, :len(expected)].tolist() == expected, row
    assert tokens.cpu().tolist() == replay(x, temperatures, seeds, bounded, top_ps).tolist()


class PoisonedRanking(sampling.SampleLaunches):
    """Fills the finalize's ranking scratch with keys of +inf logits first, so that a slot read
    back without being written draws token -1."""

    def finalize(self, logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad):
        buffers["ranked"].fill_((0xFF800000 << 32) - (1 << 64))
        super().finalize(logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad)


@pytest.mark.parametrize("target", kernel_targets()[:2])
@pytest.mark.parametrize("vocab", [40, 5000])
def test_the_finalize_ranks_only_the_tokens_it_wrote(target, vocab):
    """max_top_k = 100: 40 tokens hold fewer than k, so a radix select writes all of them;
    5,000 tokens write the tokens at or above the k-th group maximum, or the top k where ties
    pass 128."""
    device, _ = implementation(target)
    torch.manual_seed(vocab)
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(vocab, device)
    top_ks[1] = 100
    tokens, _ = sampling.sample(x, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=100,
                                launches=PoisonedRanking())
    assert tokens.cpu().tolist() == replay(x, temperatures, seeds, top_ks, top_ps, min_ps).tolist()


@pytest.mark.parametrize("target", kernel_targets())
def test_a_bound_of_one_token_is_greedy(target):
    device, sample = implementation(target)
    x, temperatures, seeds = torch.randn(3, 300, device=device), torch.ones(3, device=device), torch.arange(3, device=device)
    tokens, _ = sample(x, temperatures, seeds, torch.ones(3, dtype=torch.long, device=device), max_top_k=1)
    assert torch.equal(tokens, x.argmax(-1))


# float32 top_p: 1e-50 and 0 round to 0, 1e-45 to the least subnormal; none keeps a second token
TINY_TOP_PS = [1e-50, 0.0, 1e-45, 1e-40]


def test_reference_top_p_that_rounds_to_zero_is_greedy():
    x = torch.randn(4, 50)
    top_ps = torch.tensor(TINY_TOP_PS)
    keep = reference.sampling_mask(x, torch.ones(4), top_ps=top_ps)
    assert torch.equal(keep, torch.nn.functional.one_hot(x.argmax(-1), 50).bool())
    tokens, _ = reference.sample(x, torch.ones(4), torch.arange(4), top_ps=top_ps)
    assert torch.equal(tokens, x.argmax(-1))


def infinite_rows(vocab: int) -> torch.Tensor:
    """Rows whose p / p_max is undefined somewhere: every logit -inf, one +inf, two +inf."""
    x = torch.randn(3, vocab)
    x[0] = float("-inf")
    x[1, 7] = x[2, 3] = x[2, 9] = float("inf")
    return x


def test_reference_min_p_keeps_the_most_likely_token_of_infinite_rows():
    x = infinite_rows(50)
    tokens, _ = reference.sample(x, torch.ones(3), torch.arange(3), min_ps=torch.full((3,), 0.5))
    assert tokens.tolist() == [0, 7, 3]


@pytest.mark.parametrize("target", kernel_targets())
@pytest.mark.parametrize("max_top_k", [32, None], ids=["sort_free", "sorted"])
def test_kernel_top_p_that_rounds_to_zero_is_greedy(target, max_top_k):
    """600 tokens: max_top_k None bounds the rows by the vocabulary, past SORT_FREE_TOP_K."""
    device, sample = implementation(target)
    torch.manual_seed(4)
    x = torch.randn(4, 600, device=device)
    tokens, _ = sample(x, torch.ones(4, device=device), torch.arange(4, device=device),
                       top_ps=torch.tensor(TINY_TOP_PS, device=device), max_top_k=max_top_k)
    assert torch.equal(tokens, x.argmax(-1))


@pytest.mark.parametrize("target", kernel_targets())
def test_kernel_min_p_keeps_the_most_likely_token_of_infinite_rows(target):
    device, sample = implementation(target)
    x = infinite_rows(300).to(device)
    tokens, _ = sample(x, torch.ones(3, device=device), torch.arange(3, device=device),
                       min_ps=torch.full((3,), 0.5, device=device))
    assert tokens.tolist() == [0, 7, 3]


@pytest.mark.parametrize("target", kernel_targets())
def test_kernel_top_k_past_int32_keeps_every_token(target):
    """200 tokens, no bound: the rows filter without a sort. Cast to int32 first, these k would
    read 1 and 5."""
    device, sample = implementation(target)
    torch.manual_seed(5)
    x, temperatures, seeds = (torch.randn(8, 200, device=device), torch.ones(8, device=device),
                              torch.arange(8, device=device))
    top_ks = torch.tensor([2**32 + 1, 2**62 + 5] * 4, device=device)
    tokens, _ = sample(x, temperatures, seeds, top_ks)
    assert tokens.cpu().tolist() == replay(x, temperatures, seeds).tolist()


@pytest.mark.triton_interpret
def test_interpreted_kernel_follows_the_filtered_distribution():
    """200 draws of the Triton kernel itself with every filter: chi-square's 0.999 quantile."""
    require_triton("cpu")
    logits, temperature, top_k, top_p, min_p = CASES["everything"]
    tokens, _ = sampling.sample(*batch_of(CASES["everything"], 200), max_top_k=top_k)
    statistic, dof, outside = chi_square(tokens, exact_probs(logits, temperature, top_k, top_p, min_p))
    assert outside == 0 and statistic < CHI2_999[dof], statistic


def test_sort_path_draws_like_the_reference_filter():
    """Past SORT_FREE_TOP_K candidates the kernels filter through reference.sampling_mask."""
    launches = RecordingLaunches()
    x, temperatures, seeds, top_ks, top_ps, min_ps = mixed_batch(600, "cpu")
    sampling.sample(x, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=600, launches=launches)
    masked = launches.logits[0]
    keep = reference.sampling_mask(x, temperatures, top_ks, top_ps, min_ps)
    assert torch.equal(torch.isfinite(masked), keep & torch.isfinite(x))
    assert launches.filters == [(None, None, None)] * 2


class RecordingLaunches(sampling.SampleLaunches):
    """Records what the launches are given and writes token 0 everywhere."""

    def __init__(self):
        self.logits, self.filters = [], []

    def scan(self, logits, temperatures, seeds, filters, buffers, logprobs, groups):
        self.logits.append(logits)
        self.filters.append(filters)

    def finalize(self, logits, temperatures, seeds, filters, buffers, tokens, logprobs, k_pad):
        self.filters.append(filters)
        tokens.zero_()


def test_bad_arguments_name_the_argument():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="temperatures"):
        kernels.sample(logits, torch.ones(2), torch.arange(3))
    with pytest.raises(ValueError, match="seeds"):
        kernels.sample(logits, torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="top_ks"):
        kernels.sample(logits, torch.ones(3), torch.arange(3), top_ks=torch.ones(3))
    with pytest.raises(ValueError, match="min_ps"):
        kernels.sample(logits, torch.ones(3), torch.arange(3), min_ps=torch.ones(4))
    with pytest.raises(ValueError, match="max_top_k"):
        kernels.sample(logits, torch.ones(3), torch.arange(3), max_top_k=0)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["triton", "cuda"])
def test_large_vocabulary_draws_match_the_replay(target):
    """256 rows of Qwen3's vocabulary in bf16 with 0.6 / 20 / 0.95 and min-p rows: tokens as
    replayed, up to float rounding of the noise (GPU logarithms are approximate): at least
    98% equal; logprobs equal log_softmax of the tempered logits."""
    device, sample = implementation(target)
    torch.manual_seed(3)
    rows, vocab = 256, 151_936
    x = (torch.randn(rows, vocab, device=device) * 3).bfloat16()
    temperatures = torch.full((rows,), 0.6, device=device)
    temperatures[::7] = 0
    top_ks, top_ps = torch.full((rows,), 20, device=device), torch.full((rows,), 0.95, device=device)
    min_ps = torch.zeros(rows, device=device)
    top_ks[1::5], top_ps[1::5], min_ps[1::5] = -1, 1.0, 0.1  # min-p alone
    seeds = torch.arange(rows, device=device) * 7919
    tokens, logprobs = sample(x, temperatures, seeds, top_ks, top_ps, min_ps, max_top_k=20, logprobs=True)
    expected = replay(x, temperatures, seeds, top_ks, top_ps, min_ps)
    assert (tokens.cpu() == expected).float().mean() >= 0.98
    keep = reference.sampling_mask(x, temperatures, top_ks, top_ps, min_ps)
    assert keep.gather(1, tokens[:, None]).all()
    scale = torch.where(temperatures > 0, temperatures, 1)[:, None]
    torch.testing.assert_close(logprobs, (x.float() / scale).log_softmax(-1).gather(1, tokens[:, None]).view(-1),
                               atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["triton", "cuda"])
def test_gpu_draws_follow_the_filtered_distribution(target):
    """20,000 draws a case on the GPU: chi-square's 0.999 quantile."""
    device, sample = implementation(target)
    for name, case in CASES.items():
        logits, temperature, top_k, top_p, min_p = case
        batch = batch_of(case, 20_000, device)
        tokens, _ = sample(*batch, max_top_k=top_k or (len(logits) if top_p is not None else None))
        statistic, dof, outside = chi_square(tokens, exact_probs(logits, temperature, top_k, top_p, min_p))
        assert outside == 0 and (dof == 0 or statistic < CHI2_999[dof]), (name, statistic)


# ---- the CUDA C++ build helper, on any machine ----

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    cuda.load.cache_clear()
    monkeypatch.setattr(cuda, "_warned", False)
    monkeypatch.setenv("NANOVLLM_CUDA_CACHE", str(tmp_path))
    yield tmp_path
    cuda.load.cache_clear()


def test_build_without_a_toolkit_warns_once_and_returns_none(fresh_build, monkeypatch):
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "no CUDA toolkit (nvcc) found")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cuda.load("a", "sampling.cu", "", ("scan",)) is None
        assert cuda.load("b", "sampling.cu", "", ("scan",)) is None
    assert [str(w.message) for w in caught] == [
        "nanovllm CUDA C++ kernels unavailable, using the Triton kernels (no CUDA toolkit (nvcc) found)"]


def test_build_is_keyed_by_source_and_architecture_and_locked(fresh_build, monkeypatch):
    calls = []

    def fake_load_inline(**kwargs):
        with open(os.path.join(kwargs["build_directory"], "build.lock")) as lock:  # held by the build
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        calls.append(kwargs)
        return "module"
    from torch.utils import cpp_extension
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert cuda.load("nanovllm_x", "sampling.cu", "void scan();", ("scan",)) == "module"
    assert cuda.load("nanovllm_x", "sampling.cu", "void scan();", ("scan",)) == "module"  # once a process
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    cuda.load.cache_clear()
    cuda.load("nanovllm_x", "sampling.cu", "void scan();", ("scan",))
    hopper, ampere = calls
    assert hopper["name"] != ampere["name"] and hopper["build_directory"].startswith(str(fresh_build))
    assert "-gencode=arch=compute_90,code=sm_90" in hopper["extra_cuda_cflags"]
    assert "-gencode=arch=compute_80,code=sm_80" in ampere["extra_cuda_cflags"]
    assert hopper["functions"] == ["scan"] and "__global__" in hopper["cuda_sources"]


def test_a_failed_build_falls_back_with_one_warning(fresh_build, monkeypatch):
    from torch.utils import cpp_extension

    def failing(**kwargs):
        raise RuntimeError("Error building extension\nnvcc fatal: unsupported gpu architecture")
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cpp_extension, "load_inline", failing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.warns(UserWarning, match="unsupported gpu architecture"):
        assert cuda.load("nanovllm_y", "sampling.cu", "", ("scan",)) is None


def test_without_a_gpu_the_helper_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda.unavailable_reason() == "no CUDA device"


@pytest.mark.triton_interpret
def test_sampler_cuda_falls_back_to_triton_where_it_cannot_build(monkeypatch, fresh_build):
    monkeypatch.setattr(dispatch, "SAMPLER", "cuda")
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "no CUDA device")
    dispatch._implementation.cache_clear()
    try:
        with pytest.warns(UserWarning, match="using the Triton kernels"):
            assert dispatch._implementation("sample", "cpu") is sampling.sample
    finally:
        dispatch._implementation.cache_clear()


@pytest.mark.parametrize("edited", [False, True], ids=["plain", "masked_penalized"])
def test_finalize_compiles_for_hopper_at_the_largest_k_pad(edited):
    """The interpreter runs no MLIR pass, so a kernel it accepts can still fail to compile for a
    GPU: the finalize at SORT_FREE_TOP_K's k_pad (its largest tensors) built for sm_90 here."""
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    kernel = getattr(sampling._finalize_kernel, "kernel", sampling._finalize_kernel)
    vocab, k_pad = 151_936, sampling.next_power_of_2(sampling.SORT_FREE_TOP_K)
    buffers = sampling._buffers(1, vocab, k_pad, "meta")
    constexprs = dict(
        HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, MASKED=edited, PENALIZED=edited, LOGPROBS=False,
        GROUPS=True, CHUNKS=sampling.next_power_of_2(buffers["chunks"]),
        GROUPS_PAD=sampling.next_power_of_2(buffers["groups"]), K_PAD=k_pad, TILE=buffers["tile"],
        DIGIT=sampling.RADIX_BITS, GROUP=sampling.GROUP, NOISE_BLOCK=sampling.noise_block(vocab),
        ROUNDS=sampling.PHILOX_ROUNDS, U_MAX=sampling.U_MAX, LOG2E=sampling.LOG2E, PDL=False, logprobs_ptr=None)
    if not edited:
        constexprs.update(dict.fromkeys(("bitmask_ptr", "penalty_rows_ptr", "presence_ptr", "frequency_ptr",
                                         "repetition_ptr", "counts_ptr", "prompt_ptr")))
    integer_pointers = {"seeds_ptr": "*i64", "ranked_ptr": "*i64", "tokens_ptr": "*i64", "top_ks_ptr": "*i32",
                        "index_ptr": "*i32", "tile_key_ptr": "*i32", "gid_ptr": "*i32", "bitmask_ptr": "*i32",
                        "penalty_rows_ptr": "*i32", "counts_ptr": "*i32", "prompt_ptr": "*i32"}
    signature = {name: "constexpr" if name in constexprs else
                 integer_pointers.get(name, "*fp32") if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
    signature["logits_ptr"] = "*bf16"
    source = compiler.ASTSource(kernel, signature,
                                constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    assert compiler.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
