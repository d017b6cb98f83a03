"""GGUF checkpoints (llama.cpp's single-file format): the model's config.json fields, its
tokenizer and its tensors under Hugging Face names, read with the `gguf` library. Quantized
blocks are dequantized to float32 as they are read (the loader then casts them to the model's
dtype): the engine runs the result as it runs any other checkpoint, not the quantized blocks."""
import functools
import os
from typing import Iterable, Iterator

import numpy as np
import torch

# general.architecture -> the model registry's architecture (Mistral files say "llama").
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
# Tensor types gguf.quants dequantizes and that llama.cpp's common quantizations (Q4_K_M,
# Q5_K_M, Q8_0, ...) are made of; the I-quants and ternary types are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def _reader(path: str):
    """The file's reader, shared by the config, tokenizer and weight reads of one engine:
    building one parses every vocabulary entry (seconds for a 50k-token vocabulary)."""
    return _cached_reader(os.path.abspath(path), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: str, mtime_ns: int):
    try:
        import gguf
    except ImportError:
        raise ImportError("model: reading a GGUF file needs the gguf package: pip install 'nanovllm[gguf]'") from None
    return gguf.GGUFReader(path)  # memory-mapped: tensors are read when dequantized


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(path: str) -> dict:
    """The config.json fields of the GGUF file's model. An architecture or tensor type the
    engine does not load is a ValueError naming `model`, raised before any weight is read."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    unsupported = sorted({kind for kind in names.values() if kind not in SUPPORTED_TYPES})
    if unsupported:
        raise ValueError(f"model: GGUF tensor type(s) {', '.join(unsupported)} are not supported; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    if "rope_freqs.weight" in names:  # Llama 3.1's rope scaling, stored as per-frequency factors
        raise ValueError("model: the GGUF tensor 'rope_freqs.weight' (per-frequency rope factors) is not supported")
    meta = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    eos = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": meta("vocab_size") or (len(tokens.data) if tokens else None),
        "hidden_size": meta("embedding_length"),
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": meta("attention.key_length") or meta("rope.dimension_count"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": meta("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        # Dequantized blocks are exact in float32; dtype "auto" runs them in bf16 on a GPU.
        "torch_dtype": "float32",
        "eos_token_id": sorted({i for i in eos if i is not None}),
    }


def _rope_scaling(meta) -> dict | None:
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": meta("rope.scaling.factor")}
    if meta("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
    return scaling


def gguf_tensors(path: str, wanted: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file. `wanted`: the
    checkpoint names the model takes, which fix the GGUF -> HF name map; a tensor outside it is
    a ValueError naming it. llama.cpp stores Llama's q and k rows interleaved for its rotary
    kernel and Gemma's norms as 1 + weight: both are undone here."""
    import gguf
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    hf_names = _hf_names(arch, _field(reader, f"{arch}.block_count"), wanted)
    heads, kv_heads = (_field(reader, f"{arch}.attention.head_count{k}") for k in ("", "_kv"))
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            raise ValueError(f"model: GGUF tensor {tensor.name!r} has no place in the model")
        # A copy: float tensors come straight from the read-only memory map.
        weights = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        if arch == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            weights = _unpermute_rows(weights, heads if tensor.name.split(".")[-2] == "attn_q" else kv_heads or heads)
        if arch == "gemma" and tensor.name.endswith("norm.weight"):
            weights = weights - 1.0
        yield hf_names[tensor.name], weights


def _hf_names(arch: str, num_layers: int, wanted: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, through gguf's own table of the two namings."""
    import gguf
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    names = {}
    for hf_name in wanted:
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(stem)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _unpermute_rows(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's conversion, which reorders each head's rows from rotate-half
    pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def gguf_tokenizer(path: str):
    """transformers' tokenizer of the file (vocabulary, merges, chat template), with the BOS
    and EOS tokens the file names (transformers' reader takes its BOS for EOS too) and no
    clean-up of spaces in decoded text, as llama.cpp decodes. None for a file without one."""
    from transformers import AutoTokenizer
    reader = _reader(path)
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    for role in ("bos", "eos"):
        token_id = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
