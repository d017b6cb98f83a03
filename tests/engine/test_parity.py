"""Greedy generation of the engine equals transformers token for token, across checkpoint
kinds and across the scheduler paths (batching, preemption, chunked prefill, prefix cache)."""

import pytest

from checkpoints import config_of

STRING_PROMPTS = [
    "Hi",
    "The quick brown fox",
    "A small engine serves many requests at once by sharing memory between them.",
    "When the pool runs out, the scheduler pauses the newest sequence and computes it again "
    "later. Prompts that begin with the same words can reuse the blocks.",
]


def token_ids(outs):
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_untied", "qwen2_bias", "qwen3_sharded"])
def test_string_batch_matches_transformers(name, checkpoint, reference, new_llm, greedy):
    path = checkpoint(name)
    llm = new_llm(path)
    outs = llm.generate(STRING_PROMPTS, greedy(12), use_tqdm=False)
    ref = reference(name)
    assert token_ids(outs) == [ref(p, 12) for p in STRING_PROMPTS]
    assert [o["finish_reason"] for o in outs] == ["length"] * len(STRING_PROMPTS)
    for out in outs:
        # Whether special tokens are shown is the engine's choice; the rest must decode alike.
        decode = ref.tokenizer.decode
        assert out["text"] in {decode(out["token_ids"], skip_special_tokens=s) for s in (False, True)}


def test_checkpoint_kinds_are_what_they_claim(checkpoint):
    # Guards the parametrization above: each kind must really exercise its loading path.
    assert config_of(checkpoint("qwen2_bias"))["architectures"] == ["Qwen2ForCausalLM"]
    assert config_of(checkpoint("qwen3_untied"))["tie_word_embeddings"] is False
    assert (checkpoint("qwen3_sharded") / "model.safetensors.index.json").exists()


def test_default_arguments(checkpoint, reference, greedy):
    # The documented one-liner: device and dtype "auto" resolve to the CPU and the checkpoint's
    # float32, and the KV cache is sized without being told.
    from nanovllm import LLM

    llm = LLM(str(checkpoint("qwen3_tied")))
    outs = llm.generate(STRING_PROMPTS[:2], greedy(8), use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, 8) for p in STRING_PROMPTS[:2]]
    assert llm.memory_stats()["kv_blocks_total"] > 0


def test_token_id_batch_of_mixed_lengths(checkpoint, reference, new_llm, greedy, random_ids):
    prompts = [random_ids(n, seed=n) for n in (1, 7, 33, 90)]
    llm = new_llm(checkpoint("qwen3_tied"))
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, 10) for p in prompts]


def test_one_sampling_params_per_prompt(checkpoint, reference, new_llm, greedy):
    max_tokens = [9, 1, 4, 15]
    llm = new_llm(checkpoint("qwen3_tied"))
    outs = llm.generate(STRING_PROMPTS, [greedy(n) for n in max_tokens], use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, n) for p, n in zip(STRING_PROMPTS, max_tokens)]


def test_preemption_when_kv_cache_is_short(checkpoint, reference, new_llm, greedy, random_ids):
    # 8 blocks of 16 hold one max_model_len sequence. Five 18-token prompts take 2 blocks each
    # at admission but 3 each after 15 more tokens, so running sequences must be preempted.
    llm = new_llm(
        checkpoint("qwen3_tied"), max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=8
    )
    assert llm.memory_stats()["kv_blocks_total"] == 8
    prompts = [random_ids(18, seed=100 + i) for i in range(5)]
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, 20) for p in prompts]
    assert llm.memory_stats()["kv_blocks_used"] == 0


def test_chunked_prefill(checkpoint, reference, new_llm, greedy, random_ids):
    # 100-token prompts cannot be prefilled in one 32-token step.
    llm = new_llm(
        checkpoint("qwen3_tied"), max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4
    )
    prompts = [random_ids(100, seed=200), random_ids(5, seed=201), random_ids(70, seed=202)]
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, 12) for p in prompts]


def shared_prefix_prompts(random_ids):
    """Three prompts sharing a 3-block (48-token) prefix, with distinct tails."""
    prefix = random_ids(48, seed=300)
    return [prefix + random_ids(n, seed=301 + n) for n in (5, 11, 20)]


def test_prefix_cache_reuses_blocks(checkpoint, reference, new_llm, greedy, random_ids):
    llm = new_llm(checkpoint("qwen3_tied"), kvcache_block_size=16)
    first, *rest = shared_prefix_prompts(random_ids)
    ref = reference("qwen3_tied")
    assert token_ids(llm.generate([first], greedy(8), use_tqdm=False)) == [ref(first, 8)]
    assert llm.memory_stats()["prefix_cache_hit_blocks"] == 0
    outs = llm.generate(rest, greedy(8), use_tqdm=False)
    assert token_ids(outs) == [ref(p, 8) for p in rest]
    assert llm.memory_stats()["prefix_cache_hit_blocks"] > 0


def test_prefix_cache_whole_prompt_cached(checkpoint, reference, new_llm, greedy, random_ids):
    # A prompt of exactly two blocks, sent twice: the second time every prompt block is
    # cached, yet the engine still needs logits for the last prompt token.
    prompt = random_ids(32, seed=400)
    llm = new_llm(checkpoint("qwen3_tied"), kvcache_block_size=16)
    expected = [reference("qwen3_tied")(prompt, 6)]
    assert token_ids(llm.generate([prompt], greedy(6), use_tqdm=False)) == expected
    assert token_ids(llm.generate([prompt], greedy(6), use_tqdm=False)) == expected
    assert llm.memory_stats()["prefix_cache_hit_blocks"] > 0


def test_prefix_cache_disabled(checkpoint, reference, new_llm, greedy, random_ids):
    llm = new_llm(checkpoint("qwen3_tied"), kvcache_block_size=16, enable_prefix_caching=False)
    prompts = shared_prefix_prompts(random_ids)
    ref = reference("qwen3_tied")
    for prompt in prompts:
        assert token_ids(llm.generate([prompt], greedy(8), use_tqdm=False)) == [ref(prompt, 8)]
    assert llm.memory_stats()["prefix_cache_hit_blocks"] == 0


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k=1", "top_p~0", "min_p=1"])
def test_sampling_that_keeps_one_token_is_greedy(params, checkpoint, reference, new_llm):
    from nanovllm import SamplingParams

    llm = new_llm(checkpoint("qwen3_tied"))
    sampling = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=0, **params)
    outs = llm.generate(STRING_PROMPTS, sampling, use_tqdm=False)
    ref = reference("qwen3_tied")
    assert token_ids(outs) == [ref(p, 10) for p in STRING_PROMPTS]
