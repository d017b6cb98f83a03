"""Penalties, biases and bans in the engine, greedy and token for token against transformers'
logits processors (or OpenAI's presence / frequency formula in float64) on a tiny checkpoint,
through batching and preemption."""
import pytest
import torch
from nanovllm import SamplingParams
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from test_parity import STRING_PROMPTS

MIN_LOGIT_GAP = 1e-4


@torch.inference_mode()
def processed_greedy(ref, prompt, max_tokens: int, processors=(), presence=0.0, frequency=0.0) -> list[int]:
    """transformers' greedy continuation through `processors`, then OpenAI's presence and
    frequency penalties over the output tokens in float64; no EOS stop."""
    ids = ref.ids(prompt)
    out = []
    for _ in range(max_tokens):
        input_ids = torch.tensor([ids + out])
        logits = ref.model(input_ids).logits[:, -1].float()
        logits = LogitsProcessorList(processors)(input_ids, logits)[0].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double()
        logits = logits - frequency * counts - presence * (counts > 0)
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > MIN_LOGIT_GAP, "near-tie in the reference: choose another prompt"
        out.append(int(logits.argmax()))
    return out


def token_ids(outs):
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("penalty", [1.8, 0.6])
def test_repetition_penalty_matches_transformers(llm, ref, greedy, penalty):
    prompts = STRING_PROMPTS[1:3]
    outs = llm.generate(prompts, greedy(12, repetition_penalty=penalty), use_tqdm=False)
    expected = [processed_greedy(ref, p, 12, [RepetitionPenaltyLogitsProcessor(penalty)]) for p in prompts]
    assert token_ids(outs) == expected
    assert expected != [ref(p, 12) for p in prompts]  # the penalty changed something


def test_presence_and_frequency_follow_openais_formula(llm, ref, greedy):
    """Each prompt its own penalties, with unpenalized rows in the same batch."""
    settings = [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8), (0.0, 0.0)]
    params = [greedy(12, presence_penalty=p, frequency_penalty=f) for p, f in settings]
    outs = llm.generate(STRING_PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == [processed_greedy(ref, prompt, 12, presence=p, frequency=f)
                               for prompt, (p, f) in zip(STRING_PROMPTS, settings)]


def test_penalty_counts_survive_preemption(checkpoint, reference, new_llm, greedy, random_ids):
    """A KV cache too short for the batch preempts and recomputes sequences: their counts must
    still be those of their own output."""
    llm = new_llm(checkpoint("qwen3_tied"), max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=8)
    prompts = [random_ids(18, seed=100 + i) for i in range(5)]
    params = greedy(18, repetition_penalty=1.5, presence_penalty=0.6, frequency_penalty=0.4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.memory_stats()["num_preemptions"] > 0
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [processed_greedy(ref, p, 18, [RepetitionPenaltyLogitsProcessor(1.5)], 0.6, 0.4)
                               for p in prompts]
    llm.generate(["Hi"], greedy(1), use_tqdm=False)  # a step after they finished frees their rows
    assert not llm.model_runner.token_counts.held and llm.model_runner.token_counts.counts is None


def test_logit_bias_matches_transformers_and_plus_100_forces_a_token(llm, ref, greedy):
    prompt = STRING_PROMPTS[1]
    bias = {ref(prompt, 3)[1]: -3.0, 17: 2.5}
    out = llm.generate([prompt], greedy(10, logit_bias=bias), use_tqdm=False)[0]
    sequence_bias = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    assert out["token_ids"] == processed_greedy(ref, prompt, 10, [sequence_bias])
    forced = llm.generate([prompt], greedy(5, logit_bias={42: 100}), use_tqdm=False)[0]
    assert forced["token_ids"] == [42] * 5


def test_min_tokens_holds_back_eos_and_stop_ids(llm, ref, greedy):
    """EOS (id 1 here) forced by a bias would end the output at once; min_tokens keeps it
    out for 4 tokens, as transformers' MinNewTokensLengthLogitsProcessor does. A stop id
    likewise."""
    prompt = STRING_PROMPTS[0]
    eos = ref.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, logit_bias={eos: 30})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    processors = [MinNewTokensLengthLogitsProcessor(len(ref.ids(prompt)), 4, eos),
                  SequenceBiasLogitsProcessor({(eos,): 30.0})]
    assert out["token_ids"] == processed_greedy(ref, prompt, 5, processors)
    assert out["token_ids"][-1] == eos and out["finish_reason"] == "stop"
    first = ref(prompt, 1)[0]
    stopped = llm.generate([prompt], greedy(8, stop_token_ids=[first], min_tokens=3, logit_bias={first: 30}),
                           use_tqdm=False)[0]
    assert len(stopped["token_ids"]) == 4 and stopped["token_ids"][:3].count(first) == 0
    assert stopped["token_ids"][-1] == first


def test_bad_words_match_transformers(llm, ref, greedy):
    """"the" is two tokens, " the" one: the one is never produced, the second of the two never
    right after the first (a bias makes all three likely), as transformers' NoBadWordsLogitsProcessor."""
    prompt = STRING_PROMPTS[2]
    banned = [ref.tokenizer.encode(text, add_special_tokens=False) for text in ("the", " the")]
    assert sorted(map(len, banned)) == [1, 2]
    bias = {token: 8.0 for ids in banned for token in ids}
    out = llm.generate([prompt], greedy(12, bad_words=["the"], logit_bias=bias), use_tqdm=False)[0]
    sequence_bias = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processed_greedy(ref, prompt, 12, [sequence_bias, NoBadWordsLogitsProcessor(banned, eos_token_id=None)])
    assert out["token_ids"] == expected != processed_greedy(ref, prompt, 12, [sequence_bias])
