"""swap_layers / restore_layers on tiny random transformers models built in memory."""
from collections import Counter

import pytest
import torch
from transformers import (DynamicCache, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.llama import modeling_llama

from nanovllm import kernels
from nanovllm.kernels import dispatch, linear_ops, moe_ops, ops, staging_layout
from nanovllm.integrations.transformers import restore_layers, swap_layers

LAYERS = 2
PROMPT = 10
NEW_TOKENS = 8
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
              initializer_range=0.3)  # well above the default 0.02, so greedy picks are not near-ties
# Llama uses llama3 rope scaling and Qwen2 yarn (attention_scaling != 1): the cos/sin table must
# come from the model's own rotary module for these to match. Mistral's window is shorter than a
# prompt; Gemma has GeGLU and norms scaling by 1 + weight.
_MODELS = {
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**_SHAPE)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_SHAPE, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_SHAPE, mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**_SHAPE, sliding_window=6)),
    "gemma": (GemmaForCausalLM, lambda: GemmaConfig(**_SHAPE, hidden_act="gelu_pytorch_tanh")),
}
# RMSNorms per forward: input and post-attention per layer (Qwen3 adds q_norm and k_norm) and the final one.
_NORMS = {"qwen3": 4 * LAYERS + 1, "qwen2": 2 * LAYERS + 1, "llama": 2 * LAYERS + 1, "mistral": 2 * LAYERS + 1,
          "gemma": 2 * LAYERS + 1}
_MLP_KERNEL = {"gemma": "gelu_and_mul"}  # the others: silu_and_mul


def build(family: str, seed: int = 0, dtype=torch.float32, device="cpu"):
    model_class, make_config = _MODELS[family]
    torch.manual_seed(seed)
    return model_class(make_config()).to(device=device, dtype=dtype).eval()


def prompt(device="cpu"):
    """Two prompts, the first left-padded by three tokens, as generate sees a ragged batch."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 256, (2, PROMPT), generator=generator).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    return input_ids, attention_mask


@torch.inference_mode()
def logits(model, input_ids, attention_mask=None, **kwargs):
    return model(input_ids, attention_mask=attention_mask, **kwargs).logits


def generate(model, input_ids, attention_mask):
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, pad_token_id=0)


def rel_err(actual, expected) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts, by op name, the calls that reach nanovllm.kernels' dispatch (every public kernel goes through it)."""
    calls = Counter()
    def counting(op, device):
        calls[op] += 1
        return dispatch.implementation(op, device)

    for module in (ops, linear_ops, moe_ops, staging_layout):  # where the public kernels look their implementation up
        monkeypatch.setattr(module, "implementation", counting)
    return calls


def mlp_kernel(family):
    return _MLP_KERNEL.get(family, "silu_and_mul")


def expected_modules(model, family):
    names = {}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.input_layernorm": "rms_norm", f"{layer}.post_attention_layernorm": "rms_norm",
                  f"{layer}.mlp": mlp_kernel(family), f"{layer}.self_attn": "apply_rotary_emb"}
        if family == "qwen3":
            names |= {f"{layer}.self_attn.q_norm": "rms_norm", f"{layer}.self_attn.k_norm": "rms_norm"}
    return names | {"model.norm": "rms_norm"}


def check_swapped_model(family, backend, calls):
    model = build(family)
    input_ids, attention_mask = prompt()
    expected_logits = logits(model, input_ids, attention_mask)
    expected_tokens = generate(model, input_ids, attention_mask)
    assert not calls, "the unswapped model must not reach the kernels"

    report = swap_layers(model)
    assert report.backend == backend
    assert report.modules == expected_modules(model, family)

    actual = logits(model, input_ids, attention_mask)
    assert rel_err(actual, expected_logits) < 1e-5
    assert calls == {"rms_norm": _NORMS[family], mlp_kernel(family): LAYERS, "apply_rotary_emb": LAYERS}

    # explicit position ids, gapped and strided, must be honoured rather than assumed to count from 0
    position_ids = torch.arange(2 * PROMPT)[::2][None]
    actual = logits(model, input_ids[1:], position_ids=position_ids)
    restore_layers(model)
    expected = logits(model, input_ids[1:], position_ids=position_ids)
    swap_layers(model)
    assert rel_err(actual, expected) < 1e-5

    calls.clear()
    assert torch.equal(generate(model, input_ids, attention_mask), expected_tokens)
    assert calls["apply_rotary_emb"] == LAYERS * NEW_TOKENS, "generate must run the swapped attention every step"


@pytest.mark.parametrize("family", sorted(_MODELS))
def test_swapped_model_matches_and_runs_the_kernels(family, kernel_calls):
    check_swapped_model(family, kernels.backend_for("cpu"), kernel_calls)


@pytest.mark.triton_interpret
@pytest.mark.parametrize("family", sorted(_MODELS))
def test_swapped_model_matches_under_the_triton_interpreter(family, kernel_calls):
    assert kernels.backend_for("cpu") == "triton"
    check_swapped_model(family, "triton", kernel_calls)


@torch.inference_mode()
def decode_step(model, keyword):
    """The first layer's attention output for a token after a 6-token prefix, and the length its
    cache reaches: the prefix goes through the same attention first, the cache handed over under
    `keyword` both times."""
    torch.manual_seed(3)
    hidden, positions = torch.randn(1, 7, 64), torch.arange(7)[None]
    cos, sin = model.model.rotary_emb(hidden, positions)
    cache = DynamicCache()
    for part in (slice(0, 6), slice(6, 7)):
        output, _ = model.model.layers[0].self_attn(hidden[:, part], (cos[:, part], sin[:, part]), None,
                                                    position_ids=positions[:, part], **{keyword: cache})
    return output, cache.get_seq_length()


# transformers 5.24 renamed the attention's past_key_values to cache and still takes the old name.
@pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning")
@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_the_swapped_attention_keeps_the_cache_under_every_name_transformers_takes(keyword):
    """Without the cache the token would attend to itself alone: a wrong output that logits of
    a whole prompt, computed without a cache, never show."""
    model = build("llama")
    expected, expected_length = decode_step(model, keyword)
    swap_layers(model)
    actual, length = decode_step(model, keyword)
    assert length == expected_length
    assert rel_err(actual, expected) < 1e-5


def assert_same_parameters(model, params, state):
    assert all(param is params[name] for name, param in model.named_parameters())
    assert dict(model.named_parameters()).keys() == params.keys()
    current = model.state_dict()
    assert current.keys() == state.keys()
    assert all(torch.equal(current[name], value) for name, value in state.items())


def shares_storage(mlp) -> bool:
    return mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", sorted(_MODELS))
def test_parameters_and_state_dict_are_unchanged(family):
    model = build(family)
    params = dict(model.named_parameters())
    state = {name: value.clone() for name, value in model.state_dict().items()}
    mlp = model.model.layers[0].mlp

    swap_layers(model)
    assert shares_storage(mlp), "the swapped MLP's single matmul relies on one merged storage"
    assert_same_parameters(model, params, state)
    restore_layers(model)
    assert not shares_storage(mlp)
    assert_same_parameters(model, params, state)


def test_save_and_load_through_a_swapped_model(tmp_path):
    source, reference = build("qwen3", seed=0), build("qwen3", seed=1)
    input_ids, _ = prompt()
    swap_layers(source)
    source.save_pretrained(tmp_path)
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(reloaded, input_ids), logits(build("qwen3", seed=0), input_ids))

    # loading new weights into a swapped model must reach the merged gate/up storage
    target = build("qwen3", seed=2)
    swap_layers(target)
    target.load_state_dict(reference.state_dict())
    assert rel_err(logits(target, input_ids), logits(reference, input_ids)) < 1e-5


def test_restore_gives_back_the_original_model_exactly(kernel_calls):
    model = build("qwen3")
    input_ids, attention_mask = prompt()
    expected = logits(model, input_ids, attention_mask)
    swap_layers(model)
    names = set(restore_layers(model))

    assert names == set(expected_modules(model, "qwen3"))
    assert torch.equal(logits(model, input_ids, attention_mask), expected)
    assert not kernel_calls
    assert all("forward" not in vars(module) for module in model.modules())
    assert restore_layers(model) == [], "restoring an unswapped model is a no-op"


def test_another_model_of_the_same_class_is_untouched(kernel_calls):
    swapped, other = build("qwen3", seed=0), build("qwen3", seed=1)
    input_ids, _ = prompt()
    expected = logits(other, input_ids)
    swap_layers(swapped)
    kernel_calls.clear()

    assert torch.equal(logits(other, input_ids), expected)
    assert not kernel_calls
    assert all("forward" not in vars(module) for module in other.modules())


def _unsupported_activation():
    model = build("qwen3")
    model.config.hidden_act = "relu"
    return model


def _dynamic_rope():
    torch.manual_seed(0)
    config = LlamaConfig(**_SHAPE, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    return LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256)).eval()


@pytest.mark.parametrize("make, message", [
    (_gpt2, "LlamaForCausalLM, MistralForCausalLM, GemmaForCausalLM; got GPT2LMHeadModel"),
    (_unsupported_activation, "hidden_act"),
    (_dynamic_rope, "rope=False"),
])
def test_unsupported_models_raise_and_stay_unchanged(make, message):
    model = make()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        swap_layers(model)
    assert all("forward" not in vars(module) for module in model.modules())
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


def test_an_attention_taking_no_cache_is_refused(monkeypatch):
    """The swapped attention finds the cache through the parameter typed as one; without it the
    cache would be dropped, so the swap is refused before anything changes."""
    model = build("llama")
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", lambda self, hidden_states, **kwargs: None)
    with pytest.raises(ValueError, match="LlamaAttention.forward has no parameter typed as a Cache"):
        swap_layers(model)
    assert all("forward" not in vars(module) for module in model.modules())


def test_dynamic_rope_model_swaps_without_rope():
    report = swap_layers(_dynamic_rope(), rope=False)
    assert "apply_rotary_emb" not in report.modules.values() and "rms_norm" in report.modules.values()


def test_swapping_twice_is_harmless(kernel_calls):
    model = build("llama")
    input_ids, attention_mask = prompt()
    expected = logits(model, input_ids, attention_mask)
    first = swap_layers(model, mlp=False)
    assert "silu_and_mul" not in first.modules.values()
    second = swap_layers(model)  # adds the MLPs, leaves the rest as they are
    assert swap_layers(model) == second
    assert second.modules == expected_modules(model, "llama")

    kernel_calls.clear()
    assert rel_err(logits(model, input_ids, attention_mask), expected) < 1e-5
    assert kernel_calls == {"rms_norm": _NORMS["llama"], "silu_and_mul": LAYERS, "apply_rotary_emb": LAYERS}
    restore_layers(model)
    assert torch.equal(logits(model, input_ids, attention_mask), expected)


def _qwen3_moe(device="cpu"):
    """8 experts, 2 a token; layer 1 dense (mlp_only_layers)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                            norm_topk_prob=True, mlp_only_layers=[1])
    return Qwen3MoeForCausalLM(config).to(device=device).eval()


def check_swapped_moe_model(backend, calls, device="cpu", tokens=True):
    """`tokens`: also greedy generate's tokens (the interpreter checks the logits only: slow)."""
    model = _qwen3_moe(device)
    input_ids, attention_mask = prompt(device)
    expected_logits = logits(model, input_ids, attention_mask)
    expected_tokens = generate(model, input_ids, attention_mask) if tokens else None
    report = swap_layers(model)
    assert report.backend == backend
    assert report.modules["model.layers.0.mlp.experts"] == "fused_moe"
    assert report.modules["model.layers.1.mlp"] == "silu_and_mul"
    calls.clear()
    assert rel_err(logits(model, input_ids, attention_mask), expected_logits) < 1e-5
    assert calls["fused_moe"] == 1 and calls["silu_and_mul"] == 1
    if tokens:
        assert torch.equal(generate(model, input_ids, attention_mask), expected_tokens)
    restore_layers(model)
    assert "model.layers.0.mlp.experts" not in swap_layers(model, mlp=False).modules


def test_qwen3_moe_experts_run_the_fused_moe(kernel_calls):
    """The expert loop of a sparse layer becomes kernels.fused_moe, the dense layer's MLP the
    merged gate_up; logits and greedy tokens stay transformers'."""
    check_swapped_moe_model(kernels.backend_for("cpu"), kernel_calls)


@pytest.mark.triton_interpret
def test_qwen3_moe_experts_under_the_triton_interpreter(kernel_calls):
    assert kernels.backend_for("cpu") == "triton"
    check_swapped_moe_model("triton", kernel_calls, tokens=False)


@pytest.mark.gpu
def test_qwen3_moe_experts_on_gpu(kernel_calls):
    check_swapped_moe_model("triton", kernel_calls, "cuda")


def test_moving_a_swapped_model_merges_its_weights_again():
    model = build("qwen2")
    input_ids, attention_mask = prompt()
    expected = logits(model.double(), input_ids, attention_mask)
    model.float()
    swap_layers(model)
    model.double()  # every parameter gets fresh float64 storage, outside the fp32 merged tensor
    assert rel_err(logits(model, input_ids, attention_mask), expected) < 1e-6
    assert shares_storage(model.model.layers[0].mlp)


def test_autograd_runs_the_transformers_forward(kernel_calls):
    """The kernels have no backward: with autograd recording, gradients must equal the original model's."""
    model, reference = build("qwen3"), build("qwen3")
    input_ids, _ = prompt()
    with torch.inference_mode():  # a swap inside inference mode must not leave inference-only parameters
        swap_layers(model)
    kernel_calls.clear()
    for m in (model, reference):
        m(input_ids, labels=input_ids).loss.backward()
    assert not kernel_calls
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(param.grad, ref.grad, rtol=1e-5, atol=1e-6), name


def test_autocast_mixes_dtypes_safely():
    model = build("qwen3")
    input_ids, attention_mask = prompt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = logits(model, input_ids, attention_mask)
        swap_layers(model)
        actual = logits(model, input_ids, attention_mask)
    assert rel_err(actual, expected) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(_MODELS))
def test_bf16_on_gpu(family, kernel_calls):
    """bf16 rounds differently in the kernels (fp32 inside) and in transformers, so both are
    measured against the fp32 model: the swapped model must be about as close as the original."""
    model = build(family, dtype=torch.bfloat16, device="cuda")
    input_ids, attention_mask = prompt("cuda")
    tokens = generate(model, input_ids, attention_mask)
    mask = torch.cat((attention_mask, torch.ones_like(tokens[:, PROMPT:])), dim=1)
    real = mask.bool()  # teacher-forced over these positions, so one near-tie cannot derail the rest
    truth = logits(build(family, device="cuda"), tokens, mask)[real]
    original = logits(model, tokens, mask)[real]

    report = swap_layers(model)
    assert report.backend == "triton"
    swapped = logits(model, tokens, mask)[real]
    assert kernel_calls == {"rms_norm": _NORMS[family], mlp_kernel(family): LAYERS, "apply_rotary_emb": LAYERS}
    assert rel_err(swapped, truth) <= 1.5 * rel_err(original, truth)

    def agreement(candidate):
        return (candidate.argmax(-1) == truth.argmax(-1)).float().mean().item()
    assert agreement(swapped) >= agreement(original) - 0.1
    assert generate(model, input_ids, attention_mask).shape == tokens.shape
