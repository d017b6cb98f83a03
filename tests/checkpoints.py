"""Tiny random Qwen3/Qwen2/Llama/Mistral/Gemma checkpoints built with transformers itself, so
engine tests can compare against the reference implementation without downloading anything.

A checkpoint folder holds what a real one does: config.json, generation_config.json,
safetensors weights (single file or sharded with model.safetensors.index.json) and a
tokenizer that `transformers.AutoTokenizer` loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GemmaConfig, GemmaForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

VOCAB_SIZE = 320
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Small enough that the ~0.5 MB model splits into several files.
SHARD_SIZE = "150KB"

# original_max_position_embeddings 64 puts every scaling regime (kept, blended, divided by the
# factor) among the 16 frequencies of a 32-wide head.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
MISTRAL_WINDOW = 24  # shorter than most test prompts, 1.5 KV blocks of 16

# name -> build_checkpoint arguments, for tests/models
FAMILY_CHECKPOINTS = {
    "llama2": dict(arch="llama", tied=False),
    "llama3.1": dict(arch="llama", tied=False, rope_parameters=LLAMA3_ROPE),
    # head_dim 32 with hidden 64 and 4 heads: the q projection is wider than the hidden state
    "llama3.2": dict(arch="llama", tied=True, head_dim=32, rope_parameters=LLAMA3_ROPE, published_layout=False),
    "llama_linear_bias": dict(arch="llama", tied=False, attention_bias=True, mlp_bias=True,
                              rope_parameters=dict(rope_type="linear", rope_theta=10_000.0, factor=4.0)),
    "llama_dynamic": dict(arch="llama", tied=True, rope_parameters=dict(rope_type="dynamic", rope_theta=10_000.0,
                                                                        factor=2.0)),
    "mistral_window": dict(arch="mistral", tied=False, sliding_window=MISTRAL_WINDOW),
    "mistral_no_window": dict(arch="mistral", tied=False, sliding_window=None),
    "gemma": dict(arch="gemma", head_dim=32),
    "gemma_exact_gelu": dict(arch="gemma", hidden_act="gelu"),
    "qwen3_moe": dict(arch="qwen3_moe", tied=False),
    "qwen2_moe": dict(arch="qwen2_moe", tied=False),
}
# 8 experts, 2 a token, of which layer 1 (mlp_only_layers) has none: one dense MLP among the
# sparse ones. moe_intermediate_size 48 and 3 layers keep the file near the others' size.
MOE_CONFIG = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                  mlp_only_layers=[1], decoder_sparse_step=1)

# Training text for the tokenizer: any English works; it only has to yield enough merges to
# fill VOCAB_SIZE on top of the 256 byte-level symbols.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
A small engine serves many requests at once by sharing memory between them.
Every sequence keeps its keys and values in fixed-size blocks that live in one large pool.
When the pool runs out, the scheduler pauses the newest sequence and computes it again later.
Prompts that begin with the same words can reuse the blocks that were already filled.
Long prompts are split into chunks so that no single step grows too large.
The weather was cold and the river was frozen, so the children went skating on the ice.
She opened the book, read the first page, and then read it again because she liked it.
In the morning the market was full of people buying bread, fruit, fish and flowers.
Numbers such as one, two, three, four, five, six, seven, eight, nine and ten appear here.
"""


def _train_tokenizer() -> PreTrainedTokenizerFast:
    # Byte-level BPE so that any string encodes without unknown tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    # The model's vocabulary must cover every id the tokenizer can produce and vice versa,
    # otherwise decoding a generated id could fail.
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


ARCHS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}


def _config(arch: str, tied: bool, eos_id: int, pad_id: int, overrides: dict):
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        # Large weights spread the logits, so greedy argmax is not decided by near-ties that
        # differ between implementations at float32 rounding level.
        initializer_range=0.15,
        # Published Qwen3 value; differs from the library default so an engine that ignores
        # the configured rope base diverges within a few dozen positions.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
    )
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    config_class, model_class = ARCHS[arch]
    if arch == "qwen3_moe":
        common.update(MOE_CONFIG, norm_topk_prob=True)
    elif arch == "qwen2_moe":  # transformers' default norm_topk_prob (False) and a shared expert
        common.update(MOE_CONFIG, shared_expert_intermediate_size=80)
    return config_class(**{**common, **overrides}), model_class


def _randomize_defaults(model: torch.nn.Module, seed: int) -> None:
    """transformers starts norms at 1 and biases at 0; an engine that skipped loading them
    would still match. Perturb them so every tensor in the file matters."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def _write_published_rope_layout(path: Path) -> None:
    """transformers 5 writes `rope_parameters`; checkpoints published on the Hub (and read by
    users) carry a top-level `rope_theta` instead, and their scaling as `rope_scaling` (null
    when unscaled). Rewrite config.json to that layout."""
    config = config_of(path)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    _write_config(path, config)


def build_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    tied: bool = True,
    sharded: bool = False,
    published_layout: bool = True,
    seed: int = 0,
    **config,
) -> Path:
    """Write a tiny random checkpoint (model + tokenizer) to `path` and return it.

    arch: "qwen3" (q/k norm, no qkv bias), "qwen2" (qkv bias), "llama", "mistral" (sliding
        window unless config sets sliding_window=None) or "gemma".
    tied: share the embedding with the LM head (no lm_head.weight in the file).
    sharded: split the weights over several files with model.safetensors.index.json.
    published_layout: config.json with top-level rope_theta (and rope_scaling) like Hub
        checkpoints; False keeps the transformers 5 `rope_parameters` layout.
    config: fields of the transformers config that replace the tiny defaults (rope_parameters,
        head_dim, sliding_window, attention_bias, hidden_act, ...).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config, model_cls = _config(arch, tied, eos_id, pad_id, config)
    with torch.random.fork_rng():  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    _randomize_defaults(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(path, max_shard_size=SHARD_SIZE if sharded else "1GB")
    tokenizer.save_pretrained(path)
    if published_layout:
        _write_published_rope_layout(path)
    if sharded != (path / "model.safetensors.index.json").exists():
        raise RuntimeError(f"sharding of {path} did not come out as requested (sharded={sharded})")
    return path


def copy_checkpoint(src: str | Path, dst: str | Path, skip: tuple[str, ...] = ()) -> Path:
    """Copy a checkpoint folder, leaving out the files named in `skip`, so a test can break
    the copy without touching the shared original."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for file in Path(src).iterdir():
        if file.name not in skip:
            shutil.copy(file, dst / file.name)
    return dst


def edit_weights(path: str | Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply `edit` to the tensors of a single-file checkpoint in place."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def config_of(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _write_config(path: str | Path, config: dict) -> None:
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def edit_config(path: str | Path, **changes) -> None:
    _write_config(path, {**config_of(path), **changes})
