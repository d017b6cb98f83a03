"""Fixtures for the end-to-end engine tests: tiny checkpoints, a greedy transformers reference,
and a builder for CPU float32 engines."""

import functools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints import VOCAB_SIZE, build_checkpoint

CHECKPOINTS = {
    "qwen3_tied": dict(arch="qwen3", tied=True),
    "qwen3_untied": dict(arch="qwen3", tied=False),
    "qwen2_bias": dict(arch="qwen2", tied=True),
    # Also keeps the transformers 5 config layout, so both layouts are loaded somewhere.
    "qwen3_sharded": dict(arch="qwen3", tied=True, sharded=True, published_layout=False),
}

# Below this gap between the two best logits, float32 rounding differences between two
# correct implementations could flip greedy argmax; such a reference token is unusable.
MIN_LOGIT_GAP = 1e-4

# Engine settings shared by the tests; small so that construction and KV cache are cheap.
ENGINE_DEFAULTS = dict(
    device="cpu",
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    kvcache_block_size=16,
    num_kvcache_blocks=64,
)


class GreedyReference:
    """Greedy continuation computed with transformers, one prompt at a time.

    Implemented as a plain argmax loop over full forward passes rather than `generate`, so
    EOS has no special meaning: it matches the engine with ignore_eos=True exactly, and
    tests that care about EOS truncate the reference themselves.
    """

    def __init__(self, path: Path):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._continuations: dict[tuple[int, ...], list[int]] = {}

    def ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    @torch.inference_mode()
    def __call__(self, prompt: str | list[int], max_tokens: int) -> list[int]:
        key = tuple(self.ids(prompt))
        # A shorter greedy continuation is a prefix of a longer one: extend what is cached.
        out = self._continuations.setdefault(key, [])
        while len(out) < max_tokens:
            logits = self.model(torch.tensor([list(key) + out])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > MIN_LOGIT_GAP, (
                f"reference near-tie at step {len(out)}; choose another prompt or seed"
            )
            out.append(int(logits.argmax()))
        return out[:max_tokens]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> folder of the named entry of CHECKPOINTS, built once per session."""
    return functools.cache(lambda name: build_checkpoint(tmp_path_factory.mktemp(name), **CHECKPOINTS[name]))


@pytest.fixture(scope="session")
def reference(checkpoint):
    """reference(name) -> GreedyReference for that checkpoint, loaded once per session."""
    return functools.cache(lambda name: GreedyReference(checkpoint(name)))


@pytest.fixture(scope="module")
def llm(checkpoint, new_llm):
    """A CPU float32 engine on qwen3_tied, one per test module."""
    return new_llm(checkpoint("qwen3_tied"))


@pytest.fixture(scope="module")
def ref(reference):
    return reference("qwen3_tied")


@pytest.fixture(scope="session")
def new_llm():
    """new_llm(path, **overrides) -> a CPU float32 engine with ENGINE_DEFAULTS."""
    from nanovllm import LLM

    def make(path, **overrides):
        return LLM(str(path), **{**ENGINE_DEFAULTS, **overrides})

    return make


@pytest.fixture(scope="session")
def random_ids():
    """random_ids(n, seed) -> n reproducible token ids of ordinary (non-special) tokens."""

    def make(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        # Ids 0 and 1 are the special tokens; keep prompts free of EOS.
        return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]

    return make


@pytest.fixture(scope="session")
def greedy():
    """greedy(max_tokens, **more) -> SamplingParams for greedy decoding that ignores EOS,
    the setting in which the engine must equal GreedyReference token for token."""
    from nanovllm import SamplingParams

    def make(max_tokens: int, **more):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **more)

    return make
