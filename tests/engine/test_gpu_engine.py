"""The engine on a GPU with the Triton kernels (attention included) and CUDA graphs: greedy
tokens equal transformers' in fp32, equal the PyTorch-reference backend's, and in bf16 agree
with fp32 transformers except where the two candidate tokens' logits nearly tie."""
import json
import os
import subprocess
import sys

import pytest
import torch

from checkpoints import build_checkpoint
from test_logprobs import assert_logprobs_match

from nanovllm import LLM, SamplingParams, kernels
from nanovllm.kernels import dispatch, linear_ops

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 3, 99, 42] * 9, [200, 201], [33] * 300, list(range(40, 140))]
MAX_TOKENS = 24
# A fixed cache: sizing from free memory would count the other test processes' allocations.
ENGINE = dict(device="cuda", max_model_len=512, kvcache_block_size=16, max_num_batched_tokens=128,
              num_kvcache_blocks=256)
BF16_TIE = 2e-2  # relative logit gap below which bf16 rounding may pick either token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gpu"), arch="qwen3", tied=True)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()


def hf_greedy(model) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def engine_tokens(checkpoint, **overrides) -> list[list[int]]:
    llm = LLM(str(checkpoint), **{**ENGINE, **overrides})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_triton_engine_matches_transformers(checkpoint, hf_model, enforce_eager):
    assert kernels.backend_for("cuda") == "triton"
    assert engine_tokens(checkpoint, dtype="float32", enforce_eager=enforce_eager) == hf_greedy(hf_model)


def test_fp32_single_prompts_run_through_prefill_graphs(checkpoint, hf_model):
    """Alone, each prompt (or each 128-token chunk of it) is prefilled by a captured graph."""
    llm = LLM(str(checkpoint), **{**ENGINE, "dtype": "float32"})
    assert any(shape.max_seqlen_q > 1 for shape in llm.model_runner.graphs.graphs), "no prefill graphs were captured"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in PROMPTS]
    assert alone == hf_greedy(hf_model)


def test_fp32_triton_matches_the_torch_backend(checkpoint):
    script = ("import json, sys; from nanovllm import LLM, SamplingParams, kernels; "
              "llm = LLM(sys.argv[1], **json.loads(sys.argv[2])); "
              "p = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True); "
              "print(json.dumps([kernels.backend_for('cuda'), "
              "[o['token_ids'] for o in llm.generate(json.loads(sys.argv[3]), p, use_tqdm=False)]]))")
    env = {**os.environ, "NANOVLLM_KERNEL_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-c", script, str(checkpoint), json.dumps({**ENGINE, "dtype": "float32"}),
                          json.dumps(PROMPTS), str(MAX_TOKENS)], env=env, capture_output=True, text=True, check=True)
    backend, torch_tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert backend == "torch"
    assert engine_tokens(checkpoint, dtype="float32") == torch_tokens


def test_bf16_agrees_with_fp32_transformers_up_to_near_ties(checkpoint, hf_model):
    ours = engine_tokens(checkpoint, dtype="bfloat16")
    for prompt, tokens in zip(PROMPTS, ours):
        reference = hf_greedy_continuation(hf_model, prompt, tokens)
        for i, (got, want) in enumerate(zip(tokens, reference)):
            if got != want:
                logits = next_logits(hf_model, prompt + tokens[:i])
                gap = (logits[want] - logits[got]).abs() / logits.abs().max()
                assert gap < BF16_TIE, f"token {i}: {got} instead of {want}, relative logit gap {gap:.3g}"
                break


def hf_greedy_continuation(model, prompt, tokens) -> list[int]:
    """fp32 greedy choice at each position given the engine's own previous tokens (teacher forcing)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist()


def next_logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device="cuda")).logits[0, -1].float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemv_matches_cublas_up_to_near_ties(checkpoint, hf_model, monkeypatch, dtype):
    """Decode graphs of up to 16 sequences, 16-token prefill graphs and the LM head on the
    Triton GEMV (kernels.linear) against the same engine on cuBLAS: equal greedy tokens, in
    bf16 up to the first near-tie of fp32 transformers' logits."""
    calls, gemv = [], kernels.small_batch_linear
    monkeypatch.setattr(linear_ops, "small_batch_linear", lambda *args: calls.append(1) or gemv(*args))
    monkeypatch.setattr(dispatch, "gemv_enabled", False)
    cublas = engine_tokens(checkpoint, dtype=dtype)
    assert not calls
    monkeypatch.setattr(dispatch, "gemv_enabled", True)
    ours = engine_tokens(checkpoint, dtype=dtype)
    assert calls, "the GEMV never ran"
    for prompt, got, want in zip(PROMPTS, ours, cublas):
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is not None:
            assert dtype == "bfloat16", f"fp32 token {i}: {got[i]} instead of {want[i]}"
            logits = next_logits(hf_model, prompt + got[:i])
            gap = (logits[want[i]] - logits[got[i]]).abs() / logits.abs().max()
            assert gap < BF16_TIE, f"token {i}: {got[i]} instead of {want[i]}, relative logit gap {gap:.3g}"


def test_sampling_graphs_draw_the_eager_samplers_tokens(checkpoint):
    """Decode steps whose sequences draw without filters or log-probabilities take their
    tokens from a captured graph that also samples; the same engine without those graphs
    samples the same logits eagerly. Seeded temperature rows and a greedy one give equal
    tokens, each sequence alone and the four together; rows with a filter or
    log-probabilities never take the graph."""
    llm = LLM(str(checkpoint), **{**ENGINE, "dtype": "float32"})
    runner = llm.model_runner
    assert set(runner.graphs.sample_graphs) == set(runner.graphs.graph_logits) != set()
    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [SamplingParams(temperature=0.8, seed=1, **common), SamplingParams(temperature=0, **common),
             SamplingParams(temperature=1.3, seed=2, **common), SamplingParams(temperature=0.5, seed=3, **common)]
    filtered = [SamplingParams(temperature=1.0, top_k=20, seed=4, **common),
                SamplingParams(temperature=1.0, top_p=0.9, seed=5, **common),
                SamplingParams(temperature=1.0, min_p=0.1, seed=6, **common),
                SamplingParams(temperature=0.7, seed=7, logprobs=2, **common)]
    replays, replay = [], torch.cuda.CUDAGraph.replay

    def run(params) -> tuple[list[list[int]], list[list[int]], int]:
        """(each prompt's tokens, generated alone; generated together; replays of the graphs
        that draw)"""
        replays.clear()
        alone = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(PROMPTS, params)]
        together = [out["token_ids"] for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        return alone, together, sum(any(g is graph for graph in runner.graphs.sample_graphs.values()) for g in replays)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(graph) or replay(graph))
        plain_runs, filtered_runs = run(plain), run(filtered)
        assert plain_runs[2] >= (len(PROMPTS) + 1) * (MAX_TOKENS - 1) and filtered_runs[2] == 0
        runner.graphs.sample_graphs.clear()
        assert run(plain) == (*plain_runs[:2], 0) and run(filtered) == (*filtered_runs[:2], 0)


def test_fp32_logprobs_match_transformers(checkpoint, hf_model):
    """Through CUDA graphs, the Triton sampler and the pinned copy: greedy, seeded and filtered
    rows asking for 0 or 5, beside a row that does not ask. fp32 on the GPU: within 1e-4 of a
    float64 log_softmax of transformers' fp32 logits (teacher-forced on the engine's tokens)."""
    llm = LLM(str(checkpoint), **{**ENGINE, "dtype": "float32"})
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[3]["logprobs"] is None
    for prompt, out, sp in zip(PROMPTS, outs[:3], params):
        assert_logprobs_match(out["logprobs"], prompt, out["token_ids"], sp.logprobs, sp.temperature, hf_model,
                              atol=1e-4)
