"""ModelConfig across families: the config.json layouts of transformers 4.x and 5.x agree, each
family's transformers defaults fill what a file leaves out, and every config the engine cannot
run is a ValueError naming the field before a weight is read."""
import json

import pytest

from checkpoints import LLAMA3_ROPE, config_of
from nanovllm import LLM
from nanovllm.models import model_config

BASE = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"]}
LLAMA3_SCALING = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}


def test_llama3_layouts_of_transformers_4_and_5_agree():
    v5 = model_config({**LLAMA, "rope_parameters": LLAMA3_ROPE})
    v4 = model_config({**LLAMA, "rope_theta": LLAMA3_ROPE["rope_theta"], "rope_scaling": LLAMA3_SCALING})
    oldest = {**LLAMA3_SCALING, "type": "llama3"}
    del oldest["rope_type"]
    v4_type = model_config({**LLAMA, "rope_theta": LLAMA3_ROPE["rope_theta"], "rope_scaling": oldest})
    assert v4 == v5 == v4_type
    assert v5.rope_theta == 500_000.0 and v5.rope_scaling == LLAMA3_SCALING


def test_original_max_position_embeddings_as_transformers_reads_it():
    scaling = {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    config = {**LLAMA, "rope_scaling": scaling, "max_position_embeddings": 2048}
    assert model_config(config).rope_scaling["original_max_position_embeddings"] == 2048
    top_level = {**config, "rope_scaling": LLAMA3_SCALING, "original_max_position_embeddings": 4096}
    assert model_config(top_level).rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("architecture,expected", [
    ("LlamaForCausalLM", dict(head_dim=8, hidden_act="silu", tie_word_embeddings=False, sliding_window=None)),
    ("MistralForCausalLM", dict(head_dim=8, hidden_act="silu", tie_word_embeddings=False, sliding_window=4096)),
    ("GemmaForCausalLM", dict(head_dim=256, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    ("Qwen3MoeForCausalLM", dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                 norm_topk_prob=False, shared_expert_intermediate_size=0)),
    ("Qwen2MoeForCausalLM", dict(num_experts=60, num_experts_per_tok=4, shared_expert_intermediate_size=5632)),
])
def test_family_defaults_fill_missing_fields(architecture, expected):
    config = model_config({**BASE, "architectures": [architecture]})
    assert {name: getattr(config, name) for name in expected} == expected


def test_fields_that_switch_features_off():
    mistral = {**BASE, "architectures": ["MistralForCausalLM"]}
    assert model_config({**mistral, "sliding_window": None}).sliding_window is None
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}
    assert model_config(qwen).sliding_window is None
    gemma = {**BASE, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"}
    assert model_config(gemma).hidden_act == "gelu"
    assert model_config({**gemma, "hidden_activation": "gelu_pytorch_tanh"}).hidden_act == "gelu_pytorch_tanh"


BAD_CONFIGS = {
    "unknown_architecture": ({"architectures": ["GPT2LMHeadModel"]}, "model"),
    "no_architecture": ({"architectures": None}, "model"),
    "missing_hidden_size": ({"hidden_size": None}, "hidden_size"),
    "missing_num_hidden_layers": ({"num_hidden_layers": None}, "num_hidden_layers"),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    "longrope_v5": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters"),
    "linear_without_factor": ({"rope_scaling": {"type": "linear"}}, r"rope_scaling\.factor"),
    "llama3_without_low_freq_factor": (
        {"rope_scaling": {k: v for k, v in LLAMA3_SCALING.items() if k != "low_freq_factor"}},
        r"rope_scaling\.low_freq_factor"),
    "dynamic_factor_not_a_number": ({"rope_parameters": {"rope_type": "dynamic", "factor": "2"}},
                                    r"rope_parameters\.factor"),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "qwen_layer_windows": ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
                           "use_sliding_window"),
    "window_zero": ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    "bidirectional": ({"architectures": ["GemmaForCausalLM"], "use_bidirectional_attention": True},
                      "use_bidirectional_attention"),
    "more_experts_a_token_than_experts": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                           "num_experts_per_tok": 6}, "num_experts_per_tok"),
    "moe_intermediate_size_zero": ({"architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 0},
                                   "moe_intermediate_size"),
}


def test_moe_layers_follow_the_sparse_step_and_the_dense_list():
    config = model_config({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6,
                           "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    # transformers 5 writes the expert count as num_local_experts
    assert model_config({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8}).num_experts == 8


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_bad_config_names_the_field(name):
    change, field = BAD_CONFIGS[name]
    with pytest.raises(ValueError, match=rf"^{field}:"):
        model_config({**LLAMA, **change})


@pytest.mark.parametrize("name", ["yarn", "llama3_without_low_freq_factor", "window_zero"])
def test_bad_config_fails_before_any_weight_is_read(name, family_checkpoint, tmp_path):
    """The weights file is not even there: the error must be about the config."""
    change, field = BAD_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps({**config_of(family_checkpoint("llama3.1")), **change}))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, num_kvcache_blocks=8)

