"""Speculative decoding: greedy and seeded outputs equal with it on and off (n-gram and draft
model, with preemption and prefix sharing), every stop inside an accepted run, the target's
distribution under sampling, and speculative_config's checks."""
import argparse
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB_SIZE, build_checkpoint, copy_checkpoint
from nanovllm import SamplingParams
from nanovllm.engine import speculative
from nanovllm.engine.speculative import Speculator, ngram_proposals
from nanovllm.entrypoints.cli import add_engine_args, engine_args
from nanovllm.kernels.reference import sampling_mask

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 32
# chi-square's 0.999 quantile (Wilson-Hilferty) for `dof` degrees of freedom
Z_999 = 3.09


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3_tied")


@pytest.fixture(scope="module")
def prompts(random_ids):
    shared = random_ids(20, 99)  # over a block of 16: a prefix-cache hit for the second
    return ([random_ids(n, seed) for seed, n in enumerate((3, 9, 17, 30, 5, 12))]
            + [[7, 8, 9] * 6, [40, 41, 42, 43] * 5, shared + [3, 4], shared + [5]])


@pytest.fixture(scope="module")
def baseline(path, prompts, new_llm, greedy):
    llm = new_llm(path)
    return [out["token_ids"] for out in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]


def spec_stats(llm) -> dict:
    return {key: value for key, value in llm.memory_stats().items() if key.startswith("spec_decode")}


class FixedDraft:
    """A draft proposing `propose(seq, k)` for each sequence."""

    def __init__(self, propose):
        self.proposals, self.computed = propose, {}

    def propose(self, seqs, ks):
        return [self.proposals(seq, k) for seq, k in zip(seqs, ks)]

    def accepted(self, *args):
        pass


# --- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("config, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 4}, "speculative_config.prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
    ({**NGRAM, "model": "x"}, "speculative_config.model"),
    ({**NGRAM, "num_speculative_token": 3}, "speculative_config.num_speculative_token"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "speculative_config.prompt"),
    ("ngram", "speculative_config"),
])
def test_bad_speculative_config(path, new_llm, config, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        new_llm(path, speculative_config=config)


def test_draft_with_another_vocabulary_or_tokenizer(path, new_llm, tmp_path):
    other_vocab = copy_checkpoint(path, tmp_path / "vocab")
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB_SIZE + 64}))
    no_tokenizer = copy_checkpoint(path, tmp_path / "tokenizer", skip=("tokenizer.json", "tokenizer_config.json"))
    for draft in (other_vocab, no_tokenizer):
        with pytest.raises(ValueError, match=r"^speculative_config\.model: .*(vocabulary|tokenizer)"):
            new_llm(path, speculative_config={"method": "draft_model", "model": str(draft),
                                              "num_speculative_tokens": 2})


def test_server_flag_takes_json():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_args(args)["speculative_config"] == NGRAM
    assert engine_args(parser.parse_args([]))["speculative_config"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{ngram"])


def test_ngram_proposals_take_the_longest_most_recent_match():
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert ngram_proposals(tokens, 2, 1, 3) == [9, 2]  # "1 2 3" at 0, longer than the later "2 3"
    assert ngram_proposals(tokens, 2, 1, 2) == [8, 7]  # "2 3": the most recent occurrence
    assert ngram_proposals(tokens, 5, 1, 2) == [8, 7, 1, 2, 3]
    assert ngram_proposals(tokens, 7, 1, 2) == [8, 7, 1, 2, 3, 8, 7]  # the pattern goes on
    assert ngram_proposals([4, 4, 4], 3, 1, 3) == [4, 4, 4]
    assert ngram_proposals(tokens, 2, 4, 4) == []
    assert ngram_proposals([5], 3, 1, 3) == []


# --- greedy: token for token the same ----------------------------------------------------------
@pytest.mark.parametrize("case", ["ngram", "ngram_preempted", "draft_is_target", "draft_other", "ngram_k1"])
def test_greedy_equal_with_speculation(path, prompts, baseline, new_llm, greedy, tmp_path_factory, case):
    overrides = {"speculative_config": NGRAM}
    if case == "ngram_preempted":  # a cache of one full-length sequence: preemptions
        overrides["num_kvcache_blocks"] = 16
    elif case == "ngram_k1":
        overrides["speculative_config"] = {**NGRAM, "num_speculative_tokens": 1}
    elif case.startswith("draft"):
        draft = path if case == "draft_is_target" else build_checkpoint(tmp_path_factory.mktemp("draft"), seed=5)
        overrides["speculative_config"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = new_llm(path, **overrides)
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [out["token_ids"] for out in outs] == baseline
    stats = spec_stats(llm)
    assert stats["spec_decode_num_drafts"] > 0
    if case != "draft_other":  # random models' greedy outputs turn periodic; another model's do not match
        assert stats["spec_decode_num_accepted_tokens"] > 0
    if case == "draft_is_target":
        assert stats["spec_decode_acceptance_rate"] == 1
    if case == "ngram_preempted":
        assert llm.memory_stats()["num_preemptions"] > 0
    assert llm.memory_stats()["kv_blocks_used"] == 0


def test_draft_that_is_always_wrong(path, prompts, baseline, new_llm, greedy):
    expected = {tuple(prompt): out for prompt, out in zip(prompts, baseline)}

    def wrong(seq, k):
        out = expected[tuple(seq.token_ids[:seq.num_prompt_tokens])]
        return [(token + 1) % VOCAB_SIZE for token in (out + [0] * k)[seq.num_output_tokens:][:k]]

    llm = new_llm(path, speculative_config=NGRAM)
    llm.speculator = Speculator(llm.config.speculative, FixedDraft(wrong))
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert [out["token_ids"] for out in outs] == baseline
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] == 0


# --- stops inside accepted runs ----------------------------------------------------------------
def test_every_stop_inside_an_accepted_run(path, prompts, baseline, new_llm, greedy):
    """With the target as its own draft every proposal is accepted: each stop token, each
    max_tokens and each max_model_len falls at every place of a run of accepted tokens."""
    prompt, out = prompts[0], baseline[0]
    cases = [(prompt, greedy(MAX_TOKENS, stop_token_ids=[token])) for token in set(out)]
    cases += [(prompt, greedy(n)) for n in range(1, MAX_TOKENS + 1)]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    for llm in (new_llm(path), new_llm(path, speculative_config=spec)):
        results = llm.generate([p for p, _ in cases], [params for _, params in cases], use_tqdm=False)
        for (_, params), result in zip(cases, results):
            stop = params.stop_token_ids
            end = out.index(stop[0]) + 1 if stop else params.max_tokens
            assert result["token_ids"] == out[:end]
            assert result["finish_reason"] == ("stop" if stop else "length")
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1
    for limit in range(len(prompt) + 1, len(prompt) + 12):
        results = [new_llm(path, max_model_len=limit, **extra).generate(prompt, greedy(MAX_TOKENS), use_tqdm=False)[0]
                   for extra in ({}, {"speculative_config": spec})]
        assert results[0] == results[1] and results[1]["token_ids"] == out[:limit - len(prompt)]


def test_online_stream_gets_one_output_per_token(path, prompts, baseline, new_llm, greedy):
    llm = new_llm(path, speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 4})
    request = llm.add_request(prompts[1], greedy(MAX_TOKENS))
    stream = []
    while not llm.is_finished():
        stream += [out for out in llm.step() if out["request_id"] == request]
    assert [out["new_token_id"] for out in stream] == baseline[1]
    assert [out["finished"] for out in stream] == [False] * (MAX_TOKENS - 1) + [True]


# --- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [dict(temperature=0.3), dict(temperature=0.5, top_k=5, top_p=0.9)])
def test_seeded_equal_with_speculation(path, prompts, new_llm, params):
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, **params) for seed in range(4)]
    spec_prompts = [prompts[6], prompts[7], prompts[0], prompts[3]]
    off = new_llm(path).generate(spec_prompts, sampled, use_tqdm=False)
    for config in (NGRAM, {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}):
        llm = new_llm(path, speculative_config=config)
        assert llm.generate(spec_prompts, sampled, use_tqdm=False) == off
        assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


TINY_VOCAB = 6
PROMPT = [1, 4, 2]
# Three tokens each: the first drawn after the prompt, the next two by a step verifying one
# proposal. The CPU's reference attention runs a sequence at a time, which bounds the count.
NUM_REQUESTS = 3000
MIN_EXPECTED = 5  # cells expected less often than this are pooled into one


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny_vocab"), vocab_size=TINY_VOCAB, seed=3)


def target_probs(path, params: SamplingParams) -> torch.Tensor:
    """[V, V, V]: the probability of output tokens (a, b, c) by the definition of the filters."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = range(TINY_VOCAB)
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[:, -1]
        second = model(torch.tensor([PROMPT + [a] for a in vocab])).logits[:, -1]
        third = model(torch.tensor([PROMPT + [a, b] for a in vocab for b in vocab])).logits[:, -1]
    p1, p2, p3 = (filtered_rows(logits, params) for logits in (first, second, third))
    return p1.view(-1, 1, 1) * p2.view(TINY_VOCAB, TINY_VOCAB, 1) * p3.view(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)


def filtered_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = logits.shape[0]
    keep = sampling_mask(logits.double(), torch.full((rows,), params.temperature),
                         torch.full((rows,), params.top_k), torch.full((rows,), params.top_p))
    weights = torch.where(keep, (logits.double() / params.temperature).softmax(-1), 0)
    return weights / weights.sum(-1, keepdim=True)


SAMPLED_CASES = [dict(temperature=1.3), dict(temperature=0.9, top_k=3), dict(top_p=0.75)]


@pytest.mark.parametrize("params", SAMPLED_CASES, ids=["temperature", "top_k", "top_p"])
def test_sampled_tokens_follow_the_target(tiny_vocab, new_llm, monkeypatch, params):
    monkeypatch.setattr(speculative, "SPECULATIVE_TOKEN_BUDGET", 1 << 20)  # every row speculates
    llm = new_llm(tiny_vocab, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=4 * NUM_REQUESTS, max_model_len=8,
                  num_kvcache_blocks=NUM_REQUESTS, kvcache_block_size=8,
                  speculative_config={**NGRAM, "num_speculative_tokens": 1})
    assert_follows_target(llm, tiny_vocab, SamplingParams(max_tokens=3, ignore_eos=True, **params), NUM_REQUESTS)


def assert_follows_target(llm, path, params: SamplingParams, num_requests: int) -> None:
    """Unseeded requests of three tokens, the second token's most likely value proposed for
    it, against the target's joint distribution: chi-square at the 0.999 quantile; the
    proposal is accepted as often as the target draws it."""
    probs = target_probs(path, params)
    second = probs.sum((0, 2))
    proposal = int(second.argmax())
    llm.speculator = Speculator(llm.config.speculative, FixedDraft(lambda seq, k: [proposal]))
    outs = llm.generate([PROMPT] * num_requests, params, use_tqdm=False)
    observed = torch.zeros(TINY_VOCAB ** 3, dtype=torch.float64)
    for out in outs:
        a, b, c = out["token_ids"]
        observed[(a * TINY_VOCAB + b) * TINY_VOCAB + c] += 1
    expected = probs.flatten() * num_requests
    assert observed[expected == 0].sum() == 0
    large = expected >= MIN_EXPECTED
    small = (expected > 0) & ~large
    if small.any():
        observed = torch.cat([observed[large], observed[small].sum().view(1)])
        expected = torch.cat([expected[large], expected[small].sum().view(1)])
    else:
        observed, expected = observed[large], expected[large]
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    dof = len(expected) - 1
    assert statistic < dof * (1 - 2 / (9 * dof) + Z_999 * math.sqrt(2 / (9 * dof))) ** 3
    stats = spec_stats(llm)
    assert stats["spec_decode_num_drafts"] == num_requests
    accepted = stats["spec_decode_num_accepted_tokens"] / num_requests
    assert abs(accepted - second[proposal].item()) < 4 / math.sqrt(num_requests)


def test_metrics_export_the_counters_and_rates():
    from prometheus_client.parser import text_string_to_metric_families

    from nanovllm.entrypoints.metrics import ServerMetrics
    stats = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 6}
    samples = {sample.name: sample.value for family in text_string_to_metric_families(
        ServerMetrics("m", lambda: stats).render().decode()) for sample in family.samples}
    assert samples["nanovllm:spec_decode_num_drafts_total"] == 4
    assert samples["nanovllm:spec_decode_num_draft_tokens_total"] == 12
    assert samples["nanovllm:spec_decode_num_accepted_tokens_total"] == 6
    assert samples["nanovllm:spec_decode_acceptance_rate"] == 0.5
    assert samples["nanovllm:spec_decode_mean_accepted_length"] == 2.5
    assert not any("spec_decode" in family.name for family in text_string_to_metric_families(
        ServerMetrics("m", dict).render().decode()))
