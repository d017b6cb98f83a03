"""Loading: config.json layouts of transformers 4.x and 5.x, pickles refused, dummy weights.
(Broken-tensor errors are tested in test_errors.py.)"""
import json
from pathlib import Path

import pytest
import torch

from checkpoints import build_checkpoint, copy_checkpoint

from nanovllm import LLM
from nanovllm.models import model_config

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, kvcache_block_size=16, num_kvcache_blocks=8)
BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": [3, 4]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", tied=False)


def test_config_layouts_of_transformers_4_and_5_agree():
    v4 = model_config({**BASE, "rope_theta": 5e5, "torch_dtype": "float16"})
    v5 = model_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                "dtype": "float16"})
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.torch_dtype == torch.float16 and v4.head_dim == 8
    assert v4.eos_token_id == [3, 4] and not v4.attention_bias


def test_qwen2_has_qkv_bias_and_no_qk_norm():
    from nanovllm.models import MODEL_REGISTRY
    config = model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    options = MODEL_REGISTRY["Qwen2ForCausalLM"].options(config)
    assert options.qkv_bias and not options.o_bias and not options.qk_norm


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*Qwen2ForCausalLM.*LlamaForCausalLM"):
        model_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_pickled_weights_are_not_loaded(checkpoint, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path / "pickled", skip=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="model.*safetensors"):
        LLM(str(folder), **ENGINE)


def test_dummy_weights_need_only_config_json(checkpoint, tmp_path):
    folder = tmp_path / "config_only"
    folder.mkdir()
    (folder / "config.json").write_text((Path(checkpoint) / "config.json").read_text())
    llm = LLM(str(folder), load_format="dummy", **ENGINE)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0]
    assert len(out["token_ids"]) >= 1 and out["text"] == ""
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
