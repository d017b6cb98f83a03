"""Llama (2, 3.1, 3.2, linear and dynamic rope scaling), Mistral (with and without a sliding
window), Gemma, Qwen3-MoE and Qwen2-MoE (experts in some layers, a dense MLP in one) in the
engine equal transformers in fp32: greedy tokens through chunked
prefill, prefix sharing and preemption, and logits at every position of a teacher-forced
sequence prefilled in chunks and decoded over the paged cache."""
import pytest
import torch

from checkpoints import FAMILY_CHECKPOINTS, MISTRAL_WINDOW, copy_checkpoint, edit_config
from models.conftest import engine_logits

# Relative to the largest logit: fp32 kernels and transformers sum in different orders.
LOGIT_TOLERANCE = 1e-5
# Chunks of the teacher-forced sequence: a prefill, decodes, a chunk over the cache that is
# longer than Mistral's window, decodes.
CHUNKS = [37, 1, 1, 45, 1, 1, 14]
# One engine for all three paths: 32-token steps chunk every prompt but the last, 12 blocks
# of 16 hold about two thirds of the batch (preemption), two prompts share a 2-block prefix.
MIXED_ENGINE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, num_kvcache_blocks=12)


def mixed_prompts(random_ids):
    prefix = random_ids(32, seed=1)
    return [prefix + random_ids(6, seed=2), random_ids(70, seed=3), prefix + random_ids(30, seed=4),
            random_ids(9, seed=5)]


@pytest.mark.parametrize("name", FAMILY_CHECKPOINTS)
def test_greedy_tokens_match_transformers(name, family_checkpoint, family_reference, new_llm, greedy, random_ids):
    llm = new_llm(family_checkpoint(name), **MIXED_ENGINE)
    prompts = mixed_prompts(random_ids)
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    ref = family_reference(name)
    assert [o["token_ids"] for o in outs] == [ref(p, 16) for p in prompts]
    stats = llm.memory_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert error < LOGIT_TOLERANCE, f"largest logit difference {error:.2e} of the largest logit"


@pytest.mark.parametrize("name", FAMILY_CHECKPOINTS)
def test_teacher_forced_logits_match_transformers(name, family_checkpoint, family_reference, new_llm, random_ids):
    ids = random_ids(sum(CHUNKS), seed=7)
    expected = family_reference(name).model(torch.tensor([ids])).logits[0]
    actual = engine_logits(new_llm(family_checkpoint(name)), ids, CHUNKS)
    assert_logits_close(actual, expected)


def test_mistral_decodes_far_past_the_window_like_generate(family_checkpoint, new_llm, greedy, random_ids,
                                                           tmp_path):
    """transformers' generate with eager attention and its sliding-window cache; the same
    weights without the window decode differently, so the window is what is being matched."""
    from transformers import AutoModelForCausalLM
    path = family_checkpoint("mistral_window")
    prompt, new_tokens = random_ids(MISTRAL_WINDOW + 6, seed=8), 4 * MISTRAL_WINDOW
    llm = new_llm(path)
    tokens = llm.generate([prompt], greedy(new_tokens), use_tqdm=False)[0]["token_ids"]

    def generate(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
        return out[0, len(prompt):].tolist()

    assert tokens == generate(path)
    unwindowed = copy_checkpoint(path, tmp_path / "no_window")
    edit_config(unwindowed, sliding_window=None)
    assert generate(unwindowed) != tokens


def test_gemma_hidden_activation_overrides_hidden_act(family_checkpoint, family_reference, new_llm, random_ids,
                                                      tmp_path):
    """The published Gemma configs say hidden_act "gelu" and hidden_activation
    "gelu_pytorch_tanh", the activation the models were trained with: the engine runs the
    latter, as the checkpoint built with it does in transformers."""
    path = copy_checkpoint(family_checkpoint("gemma"), tmp_path / "gemma")
    edit_config(path, hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")
    ids = random_ids(sum(CHUNKS), seed=9)
    expected = family_reference("gemma").model(torch.tensor([ids])).logits[0]
    assert_logits_close(engine_logits(new_llm(path), ids, CHUNKS), expected)


@pytest.mark.triton_interpret
@pytest.mark.parametrize("name", ["mistral_window", "gemma"])
def test_triton_kernels_match_transformers(name, family_checkpoint, family_reference, new_llm, greedy, random_ids):
    """The sliding window and the GeGLU MLP through the Triton kernels (interpreted)."""
    from nanovllm import kernels
    assert kernels.backend_for("cpu") == "triton"
    llm = new_llm(family_checkpoint(name), max_num_batched_tokens=32)
    prompts = [random_ids(40, seed=10), random_ids(3, seed=11)]
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    ref = family_reference(name)
    assert [o["token_ids"] for o in outs] == [ref(p, 8) for p in prompts]


@pytest.mark.triton_interpret
def test_fused_moe_kernels_match_transformers(family_checkpoint, family_reference, new_llm, greedy, random_ids):
    """Routing, alignment and the grouped GEMMs through the Triton kernels (interpreted): a
    prefill of 24 tokens over 8 experts and decode steps of one token, which reach only 2."""
    from nanovllm import kernels
    assert kernels.backend_for("cpu") == "triton"
    llm = new_llm(family_checkpoint("qwen3_moe"))
    prompt = random_ids(24, seed=13)
    tokens = llm.generate([prompt], greedy(3), use_tqdm=False)[0]["token_ids"]
    assert tokens == family_reference("qwen3_moe")(prompt, 3)


def test_gemma_in_bf16_keeps_its_norm_scales_in_fp32(family_checkpoint, new_llm, greedy, random_ids):
    """1 + w exactly, from w in bf16 as transformers adds it: a bf16 scale near 1.0 steps by
    2^-7, most of a small w. Everything else stays bf16, and the mixed model generates."""
    from safetensors.torch import load_file
    path = family_checkpoint("gemma")
    checkpoint = load_file(path / "model.safetensors")
    llm = new_llm(path, dtype="bfloat16")
    params = dict(llm.model_runner.model.named_parameters())
    norms = {name: param for name, param in params.items() if name.endswith("norm.weight")}
    assert norms.keys() == {name for name in checkpoint if name.endswith("norm.weight")}
    for name, param in norms.items():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, checkpoint[name].to(torch.bfloat16).float() + 1), name
    assert all(param.dtype == torch.bfloat16 for name, param in params.items() if name not in norms)
    assert len(llm.generate([random_ids(20, seed=12)], greedy(4), use_tqdm=False)[0]["token_ids"]) == 4
