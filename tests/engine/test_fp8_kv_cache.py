"""kv_cache_dtype="fp8" end to end on the CPU (the PyTorch reference kernels): the cache is
float8 e4m3 with twice the blocks for the same bytes, logits stay close to those over a float32
cache, and prefix caching and preemption give what the same FP8 engine gives without them."""
import pytest
import torch
from safetensors.torch import save_file
from test_parity import shared_prefix_prompts, token_ids

from nanovllm.utils.context import reset_context, set_context

# Relative L2 error of the teacher-forced logits against a float32 cache: 5.9e-2 measured on
# the tiny random qwen3 checkpoint, with 90% of greedy tokens agreeing (its logits lie close
# together). e4m3 keeps 3 mantissa bits: each key and value is off by up to 6.25%; scales
# calibrated to each layer's largest value measured no better (5.7e-2), the values lying in
# e4m3's normal range either way.
LOGIT_ERROR_BOUND = 0.1
MIN_GREEDY_AGREEMENT = 0.8


def teacher_forced_logits(runner, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits of every position of one sequence over the runner's cache blocks 0, 1, ...: the
    first `prefill` tokens in one step, then a decode step per token, each fed the given token."""
    table = torch.arange(-(-len(tokens) // runner.block_size), dtype=torch.int32)[None]
    logits = []
    with torch.inference_mode():
        for start, end in [(0, prefill), *((t, t + 1) for t in range(prefill, len(tokens)))]:
            set_context(cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                        seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                        slot_mapping=torch.arange(start, end), max_seqlen_q=end - start)
            hidden = runner.model(torch.tensor(tokens[start:end]), torch.arange(start, end))
            logits.append(runner.model.compute_logits(hidden))
    reset_context()
    return torch.cat(logits)


def test_fp8_logits_stay_close_to_a_float32_cache(checkpoint, new_llm, random_ids):
    tokens = random_ids(150, seed=7)
    logits = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = new_llm(checkpoint("qwen3_tied"), kv_cache_dtype=kv_cache_dtype)
        runner = llm.model_runner
        assert runner.kv_cache.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
        logits[kv_cache_dtype] = teacher_forced_logits(runner, tokens, 100)
        llm.close()
    error = ((logits["fp8"] - logits["auto"]).norm() / logits["auto"].norm()).item()
    agreement = (logits["fp8"].argmax(-1) == logits["auto"].argmax(-1)).double().mean().item()
    print(f"\nFP8 KV against a float32 cache, {len(tokens)} teacher-forced positions: relative logit error "
          f"{error:.2e}, greedy agreement {agreement:.1%}")
    assert 0 < error < LOGIT_ERROR_BOUND
    assert agreement >= MIN_GREEDY_AGREEMENT


def test_fp8_cache_holds_twice_the_blocks(checkpoint, new_llm):
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = new_llm(checkpoint("qwen3_tied"), kv_cache_dtype=kv_cache_dtype, dtype="bfloat16")
        sizes[kv_cache_dtype] = llm.model_runner.block_bytes()
        llm.close()
    assert sizes["auto"] == 2 * sizes["fp8"]


def test_prefix_cache_and_preemption_match_a_plain_fp8_run(checkpoint, new_llm, greedy, random_ids):
    path = checkpoint("qwen3_tied")
    first, *rest = shared_prefix_prompts(random_ids)
    preempted = [random_ids(18, seed=100 + i) for i in range(5)]
    plain = new_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = {tuple(p): out for p, out in zip([first, *rest, *preempted], token_ids(
        plain.generate([first, *rest, *preempted], greedy(20), use_tqdm=False)))}
    plain.close()

    cached = new_llm(path, kv_cache_dtype="fp8")
    assert token_ids(cached.generate([first], greedy(20), use_tqdm=False)) == [want[tuple(first)]]
    assert token_ids(cached.generate(rest, greedy(20), use_tqdm=False)) == [want[tuple(p)] for p in rest]
    assert cached.memory_stats()["prefix_cache_hit_blocks"] > 0
    cached.close()

    # 8 blocks of 16: five 18-token prompts growing by 20 tokens each must preempt
    short = new_llm(path, kv_cache_dtype="fp8", max_model_len=128, num_kvcache_blocks=8)
    assert token_ids(short.generate(preempted, greedy(20), use_tqdm=False)) == [want[tuple(p)] for p in preempted]
    assert short.memory_stats()["num_preemptions"] > 0
    short.close()


def test_checkpoint_kv_scales_reach_the_layers(checkpoint, new_llm, tmp_path, greedy, random_ids):
    """k_scale / v_scale tensors (as HF and vLLM FP8 checkpoints store them) set each layer's
    scales; a checkpoint without them leaves 1.0, and a float32 cache ignores them."""
    path = tmp_path / "scaled"
    path.mkdir()
    for item in checkpoint("qwen3_tied").iterdir():
        (path / item.name).symlink_to(item)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
               "model.layers.1.self_attn.v_scale": torch.tensor([2.0])}, path / "kv_scales.safetensors")
    llm = new_llm(path, kv_cache_dtype="fp8")
    layers = llm.model_runner.attention_layers
    assert [(a.k_scale, a.v_scale) for a in layers[:2]] == [(0.25, 1.0), (1.0, 2.0)]
    assert llm.generate([random_ids(10, seed=1)], greedy(4), use_tqdm=False)[0]["token_ids"]
    llm.close()
    llm = new_llm(path)
    assert {(a.k_scale, a.v_scale) for a in llm.model_runner.attention_layers} == {(1.0, 1.0)}
    llm.close()


def test_bad_checkpoint_kv_scale_names_the_tensor(checkpoint, new_llm, tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    for item in checkpoint("qwen3_tied").iterdir():
        (path / item.name).symlink_to(item)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, path / "kv_scales.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale"):
        new_llm(path, kv_cache_dtype="fp8")


@pytest.mark.parametrize("value", ["fp16", "fp8_e5m2", "", None])
def test_unsupported_kv_cache_dtype_is_rejected_before_any_allocation(checkpoint, value, monkeypatch):
    from nanovllm import LLM
    from nanovllm.engine import llm_engine
    monkeypatch.setattr(llm_engine, "ModelRunner", lambda *a, **k: pytest.fail("the model runner was built"))
    with pytest.raises(ValueError, match="^kv_cache_dtype: "):
        LLM(str(checkpoint("qwen3_tied")), device="cpu", kv_cache_dtype=value)
