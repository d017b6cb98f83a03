"""GGUF files written here from tiny checkpoints, as llama.cpp's converter writes them (its
Llama q/k row order, Gemma norms stored as 1 + weight, weights in each quantization type), load
into the same parameters as a checkpoint folder of their dequantized weights; unsupported
architectures and tensor types are refused before any weight is read."""
import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from checkpoints import build_checkpoint, copy_checkpoint, edit_weights
from engine.conftest import GreedyReference, greedy, new_llm, random_ids  # noqa: F401
from nanovllm.models import MODEL_REGISTRY, model_config, model_config_from_dir
from nanovllm.utils.gguf import gguf_model_config
from nanovllm.utils.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0"]
# K-quant blocks span 256 input features, so every quantized matrix is 256 wide.
K_WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Byte offsets of the float16 scales in a block, for the types gguf.quants cannot quantize.
K_SCALES = {"Q5_K": (0, 2), "Q6_K": (208,)}


def _quantized(weight: torch.Tensor, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Rows of weight in qtype's storage (the raw blocks of quantized types)."""
    kind = gguf.GGMLQuantizationType[qtype]
    data = weight.numpy()
    if qtype == "F32":
        return data
    if qtype == "F16":
        return data.astype(np.float16)
    if qtype not in K_SCALES:
        return gguf.quants.quantize(data, kind)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (data.shape[0], data.shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALES[qtype]:
        blocks[:, :, offset:offset + 2] = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    return blocks.reshape(data.shape[0], -1)


def _interleave_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama conversion: each head's rotate-half pairs (i, i + d/2) become adjacent."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(folder, out, qtype: str, arch: str, seed: int = 0):
    """`folder`'s model as a GGUF file with its matrices in qtype (norms and biases in F32), and
    the folder's weights replaced by what the file dequantizes to. Returns the file's path."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(seed)
    layers = config["num_hidden_layers"]
    table = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    dequantized = {}
    for name, weight in tensors.items():
        stem, _, suffix = name.rpartition(".")
        gguf_name = f"{table.get_name(stem)}.{suffix}"
        kind = qtype if weight.dim() == 2 else "F32"
        stored = _quantized(weight, kind, rng)
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind]).copy())
        if arch == "llama" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
            heads = config["num_attention_heads" if "attn_q." in gguf_name else "num_key_value_heads"]
            stored = _interleave_rows(stored, heads)
        if arch == "gemma" and gguf_name.endswith("norm.weight"):
            stored = stored + 1.0
        raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, stored, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    edit_weights(folder, lambda t: t.update(dequantized))
    return out


def loaded_state(path) -> dict[str, torch.Tensor]:
    config = model_config(gguf_model_config(str(path))) if str(path).endswith(".gguf") else model_config_from_dir(path)
    model = MODEL_REGISTRY[config.architecture](config)
    load_model(model, str(path))
    return model.state_dict()


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("wide"), arch="llama", tied=False, num_hidden_layers=1, **K_WIDE)


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_loads_as_its_dequantized_weights(tmp_path, wide_llama, qtype):
    folder = copy_checkpoint(wide_llama, tmp_path / "hf")
    path = write_gguf(folder, tmp_path / "model.gguf", qtype, "llama")
    expected, loaded = loaded_state(folder), loaded_state(path)
    assert expected.keys() == loaded.keys()
    for name in expected:
        torch.testing.assert_close(loaded[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "gemma"])
def test_other_families_load_as_their_weights(tmp_path, arch):
    folder = build_checkpoint(tmp_path / "hf", arch=arch)
    path = write_gguf(folder, tmp_path / "model.gguf", "F32", arch)
    # float32 metadata rounds the epsilon; the file has no attention_bias field (Qwen2 always has biases)
    from_file, from_folder = (dataclasses.asdict(c) for c in (model_config(gguf_model_config(str(path))),
                                                             model_config_from_dir(folder)))
    assert from_file.pop("rms_norm_eps") == pytest.approx(from_folder.pop("rms_norm_eps"), rel=1e-6)
    from_file.pop("attention_bias"), from_folder.pop("attention_bias")
    assert from_file == from_folder
    expected, loaded = loaded_state(folder), loaded_state(path)
    for name in expected:
        torch.testing.assert_close(loaded[name], expected[name], rtol=0, atol=0, msg=name)


def test_engine_on_gguf_matches_transformers_on_dequantized_weights(tmp_path, new_llm, greedy, random_ids):
    """Q8_0 Llama file with untied head, end to end: the engine's greedy tokens equal
    transformers' on the dequantized checkpoint."""
    folder = build_checkpoint(tmp_path / "hf", arch="llama", tied=False)
    path = write_gguf(folder, tmp_path / "model.gguf", "Q8_0", "llama")
    reference = GreedyReference(folder)
    prompts = [random_ids(12, seed) for seed in range(3)]
    outs = new_llm(path).generate(prompts, greedy(12), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [reference(p, 12) for p in prompts]


def test_unsupported_architecture_and_type_are_refused_before_loading(tmp_path, new_llm):
    phi = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    phi.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    phi.write_header_to_file(), phi.write_kv_data_to_file(), phi.write_tensors_to_file(), phi.close()
    with pytest.raises(ValueError, match="model: GGUF architecture 'phi2' is not supported"):
        new_llm(tmp_path / "phi.gguf")
    iq = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    iq.add_tensor("token_embd.weight", np.zeros((4, 144), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    iq.write_header_to_file(), iq.write_kv_data_to_file(), iq.write_tensors_to_file(), iq.close()
    with pytest.raises(ValueError, match="model: GGUF tensor type.* IQ4_NL"):
        new_llm(tmp_path / "iq.gguf")
