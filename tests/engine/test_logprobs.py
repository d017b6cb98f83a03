"""SamplingParams.logprobs through the engine: every entry against a float64 log_softmax of
transformers' logits, teacher-forced on the engine's own tokens, for greedy and seeded sampling,
mixed batches, preemption and the online step() API."""
import pytest
import torch

# fp32 engine against fp32 transformers, compared in float64: the two differ by float32
# rounding of the same logits (about 1.5e-6 here).
ATOL = {torch.float32: 2e-5}
MIXED_ENGINE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, num_kvcache_blocks=12)


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """[len(output), V] float64 log_softmax(logits / T) (T = 1 when greedy) at each output position, on the CPU."""
    logits = model(torch.tensor([prompt + output], device=model.device)).logits[0, len(prompt) - 1:-1].double()
    return (logits / (temperature or 1.0)).log_softmax(dim=-1).cpu()


def assert_logprobs_match(entries, prompt, output, num, temperature, model, atol=ATOL[torch.float32]):
    """One entry a token; each holds the sampled token and the num most likely, at the values
    of the reference."""
    expected = reference_logprobs(model, prompt, output, temperature)
    assert len(entries) == len(output)
    for entry, token, row in zip(entries, output, expected):
        assert token in entry and len(entry) in (num, num + 1)
        ids = list(entry)
        torch.testing.assert_close(torch.tensor([entry[i] for i in ids], dtype=torch.float64), row[ids],
                                   atol=atol, rtol=0)
        if num:  # the other entries are the reference's num largest, up to the tolerance at a tie
            nth = row.topk(num).values[-1]
            assert row[[i for i in ids if i != token]].min() >= nth - atol
            assert len(entry) == num or row[token] <= nth + atol  # the token is one of them, or below them


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 11)])
def test_generate_logprobs_match_transformers(llm, ref, random_ids, temperature, seed):
    from nanovllm import SamplingParams
    prompts = [random_ids(n, seed=n) for n in (5, 19, 33)]
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=10, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_logprobs_match(out["logprobs"], prompt, out["token_ids"], 5, temperature, ref.model)


def test_batch_mixing_requests_with_and_without_logprobs(llm, ref, random_ids, greedy):
    prompts = [random_ids(7, seed=s) for s in range(4)]
    asked = [None, 0, 3, 20]
    outs = llm.generate(prompts, [greedy(6, logprobs=n) for n in asked], use_tqdm=False)
    assert outs[0]["logprobs"] is None and set(outs[0]) == {"text", "token_ids", "finish_reason", "logprobs"}
    for prompt, out, n in zip(prompts[1:], outs[1:], asked[1:]):
        assert_logprobs_match(out["logprobs"], prompt, out["token_ids"], n, 0.0, ref.model)
        assert out["token_ids"] == ref(prompt, 6)  # asking for log-probabilities leaves the tokens as they are
    assert all(len(entry) == 1 for entry in outs[1]["logprobs"])


def test_preempted_requests_keep_one_entry_per_token(checkpoint, ref, new_llm, random_ids):
    from nanovllm import SamplingParams
    llm = new_llm(checkpoint("qwen3_tied"), **MIXED_ENGINE)
    prefix = random_ids(32, seed=1)
    prompts = [prefix + random_ids(6, seed=2), random_ids(70, seed=3), prefix + random_ids(30, seed=4),
               random_ids(9, seed=5)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=16, ignore_eos=True, logprobs=2) for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.memory_stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_logprobs_match(out["logprobs"], prompt, out["token_ids"], 2, 0.7, ref.model)


def test_step_outputs_carry_the_new_tokens_logprobs(llm, ref, random_ids, greedy):
    prompts = [random_ids(12, seed=21), random_ids(4, seed=22)]
    asking = llm.add_request(prompts[0], greedy(7, logprobs=4))
    silent = llm.add_request(prompts[1], greedy(5))
    entries, tokens = {asking: [], silent: []}, {asking: [], silent: []}
    while not llm.is_finished():
        for out in llm.step():
            entries[out["request_id"]].append(out["logprobs"])
            tokens[out["request_id"]].append(out["new_token_id"])
    assert entries[silent] == [None] * 5
    assert tokens[asking] == ref(prompts[0], 7)
    assert_logprobs_match(entries[asking], prompts[0], tokens[asking], 4, 0.0, ref.model)
