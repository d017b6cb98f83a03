"""Speculative decoding on a GPU with CUDA graphs (verification graphs included): greedy and
seeded outputs equal with it on and off, and 10^5 draws follow the target's distribution."""
import pytest

from checkpoints import build_checkpoint
from test_speculative import NGRAM, SAMPLED_CASES, TINY_VOCAB, assert_follows_target

from nanovllm import LLM, SamplingParams
from nanovllm.engine import speculative

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 3, 99, 42] * 9, [200, 201], [33] * 300, list(range(40, 140)), [7, 8, 9] * 6]
ENGINE = dict(device="cuda", dtype="float32", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=256)
NUM_REQUESTS = 50_000  # three tokens each: 1.5 * 10^5 draws


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gpu_spec"), arch="qwen3", tied=True)


def outputs(checkpoint, params, **overrides):
    llm = LLM(str(checkpoint), **{**ENGINE, **overrides})
    outs = [out["token_ids"] for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outs, llm


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.3, seed=7),
                                    dict(temperature=0.5, top_k=5, top_p=0.9, seed=3)])
def test_equal_with_speculation_in_graphs(checkpoint, params):
    params = SamplingParams(max_tokens=48, ignore_eos=True, **params)
    off, _ = outputs(checkpoint, params)
    for config in (NGRAM, {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}):
        on, llm = outputs(checkpoint, params, speculative_config=config)
        assert any(shape.max_seqlen_q > 1 and shape.seqs > 2 for shape in llm.model_runner.graphs.graphs)
        assert on == off
        assert llm.memory_stats()["spec_decode_num_accepted_tokens"] > 0
        llm.close()


@pytest.mark.parametrize("params", SAMPLED_CASES, ids=["temperature", "top_k", "top_p"])
def test_sampled_tokens_follow_the_target(tmp_path_factory, monkeypatch, params):
    path = build_checkpoint(tmp_path_factory.mktemp("tiny_vocab"), vocab_size=TINY_VOCAB, seed=3)
    monkeypatch.setattr(speculative, "SPECULATIVE_TOKEN_BUDGET", 1 << 20)  # every row speculates
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=512, max_num_batched_tokens=4096,
              max_model_len=8, kvcache_block_size=8, num_kvcache_blocks=1024,
              speculative_config={**NGRAM, "num_speculative_tokens": 1})
    assert_follows_target(llm, path, SamplingParams(max_tokens=3, ignore_eos=True, **params), NUM_REQUESTS)
