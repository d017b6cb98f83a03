"""The engine split over two CPU processes (tensor_parallel_size=2, gloo) and as two replicas
(data_parallel_size=2): greedy tokens equal one process's and transformers' in fp32, with
prefix caching, chunked prefill and preemption in the mix; the logits of every sampled row
(teacher-forced: each step conditions on tokens equal to transformers' greedy ones) close to
the single-process engine's and to transformers'."""
import os
import signal

import pytest
import torch

from parallel_testing import ENGINE, call_with_timeout, child_pids
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.worker import WorkerError

# 32-token steps chunk every prompt; 10 blocks of 16 hold two sequences of 80 tokens at most,
# so four sequences growing past 64 tokens preempt one another.
MIX = {**ENGINE, "max_model_len": 128, "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kvcache_blocks": 10}
PREFIX = [(7 * i) % 300 + 2 for i in range(48)]  # three blocks shared by the prompts below
PROMPTS = [PREFIX + [5, 9], PREFIX + list(range(40, 60)), PREFIX + [200] * 11, list(range(100, 141))]
MAX_TOKENS = 24
# fp32 logits of one model computed in two ways: rounding-level differences only.
LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class LogitsRecorder(ModelRunner):
    """Keeps rank 0's logits of every sampled row, in order."""

    def _logits(self, hidden, step, graph_logits=None):
        logits = super()._logits(hidden, step, graph_logits)
        if logits is not None:
            self.__dict__.setdefault("recorded", []).append(logits.float().cpu())
        return logits


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_mix(checkpoint, tensor_parallel_size: int) -> dict:
    """The prompts one after another, then together: the later runs hit the prefix cache, and
    together they preempt each other."""
    with LLM(str(checkpoint), tensor_parallel_size=tensor_parallel_size, **MIX) as llm:
        alone = [llm.generate([p], greedy(), use_tqdm=False)[0]["token_ids"] for p in PROMPTS]
        together = [o["token_ids"] for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
        stats = llm.memory_stats()
        logits = torch.cat(llm.model_runner.recorded)
    return dict(alone=alone, together=together, stats=stats, logits=logits)


@pytest.fixture(scope="module")
def runs(checkpoint):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "ModelRunner", LogitsRecorder)  # rank 0's class: its ranks build the same
        return {size: run_mix(checkpoint, size) for size in (1, 2)}


def test_tp2_tokens_equal_tp1_and_transformers(runs, hf):
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    assert runs[2]["alone"] == runs[2]["together"] == expected
    assert runs[1]["alone"] == runs[1]["together"] == expected
    stats = runs[2]["stats"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0
    assert stats["kv_blocks_total"] == MIX["num_kvcache_blocks"]
    assert not child_pids()


def test_tp2_logits_close_to_tp1_and_transformers(runs, hf):
    # The same steps ran on both engines: one row per sampled token, in the same order.
    assert runs[2]["logits"].shape == runs[1]["logits"].shape == (2 * len(PROMPTS) * MAX_TOKENS, 320)
    torch.testing.assert_close(runs[2]["logits"], runs[1]["logits"], **LOGITS_TOLERANCE)
    # The first runs took one prompt at a time: prompt p's rows come in order.
    rows = runs[2]["logits"][:len(PROMPTS) * MAX_TOKENS].split(MAX_TOKENS)
    for prompt, tokens, logits in zip(PROMPTS, runs[2]["alone"], rows):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(logits, expected, **LOGITS_TOLERANCE)


def test_dp2_equals_one_engine_and_fails_loudly(checkpoint):
    prompts = PROMPTS + ["The quick brown fox", torch.tensor([3, 4, 5])]
    expected = LLM(str(checkpoint), **ENGINE).generate(prompts, greedy(), use_tqdm=False)
    with LLM(str(checkpoint), data_parallel_size=2, **ENGINE) as llm:
        assert sorted(llm._shares(prompts, [greedy()] * len(prompts))) == [0, 1]  # both replicas take a share
        assert llm.generate(prompts, greedy(), use_tqdm=False) == expected
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[5, 10_000], PROMPTS[0]], greedy(), use_tqdm=False)
        assert llm.generate(prompts[:2], greedy(), use_tqdm=False) == expected[:2]  # still serving
        os.kill(llm.replicas.processes[1].pid, signal.SIGKILL)
        error = call_with_timeout(llm.generate, prompts, greedy(), False)
        assert isinstance(error, WorkerError) and "data-parallel replica 1 exited" in str(error)
    assert not child_pids()



def test_tp2_speculative_tokens_equal_plain(checkpoint):
    """n-gram verification steps over two ranks, preempting one another: the same greedy tokens
    as decoding without speculation, with proposals accepted."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    prompts = [[5, 17, 3, 99, 42] * 9, PREFIX + [200] * 11, list(range(100, 141))]
    with LLM(str(checkpoint), tensor_parallel_size=2, **MIX) as llm:
        plain = [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    with LLM(str(checkpoint), tensor_parallel_size=2, speculative_config=config, **MIX) as llm:
        speculative = [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)]
        accepted = llm.memory_stats()["spec_decode_num_accepted_tokens"]
    assert speculative == plain
    assert accepted > 0


def test_tp2_draft_model_is_refused_before_any_process_starts(checkpoint):
    config = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(checkpoint), tensor_parallel_size=2, speculative_config=config, **MIX)
