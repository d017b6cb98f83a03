"""The sampler's warm-up at engine start launches every variant of the sampling kernels that a
request can reach, so that no request waits for Triton to compile one. Under Triton's
interpreter each launch is keyed as Triton keys its compiled variants: the keys that steps
with many different sampling parameters launch are among the warm-up's. On a GPU, requests
after LLM() compile no sampling kernel."""
import inspect
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanovllm
from checkpoints import build_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import dispatch, linear_ops, ops, reference, staging_layout

SAMPLING_OPS = {"sample", "publish_tokens"}  # the Triton kernels a step's sampling launches
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, kvcache_block_size=16, num_kvcache_blocks=48,
              max_num_seqs=16)


def specialization(value):
    """What Triton's binder keys a compiled variant on, for an argument that is no constexpr:
    a tensor's dtype and 16-byte alignment, whether an int is 1 or a multiple of 16, the type
    of other numbers; None is a constant."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, int) and not isinstance(value, bool):
        return "int", value == 1, value % 16 == 0
    return value if value is None else type(value).__name__


class Recorder:
    """Stands in for a Triton kernel: records the key of each launch, then launches it.
    Constexpr parameters and launch options (num_warps, ...) are keyed by their value."""

    def __init__(self, kernel, name: str, keys: set):
        self.kernel, self.name, self.keys = kernel, name, keys
        self.params = inspect.signature(kernel.fn).parameters

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add((self.name, tuple(sorted((name, self._key(name, value)) for name, value
                                                   in {**dict(zip(self.params, args)), **kwargs}.items()))))
            return self.kernel[grid](*args, **kwargs)
        return launch

    def _key(self, name: str, value):
        constexpr = name not in self.params or "constexpr" in str(self.params[name].annotation)
        return value if constexpr else specialization(value)


@pytest.fixture
def launched(monkeypatch) -> set:
    """The keys of the sampling kernels' launches, which run on Triton's interpreter while the
    rest of the engine runs on the PyTorch references (fast enough for many steps)."""
    from nanovllm.kernels import sampling, staging
    keys = set()
    for module, name in [(sampling, "_scan_kernel"), (sampling, "_min_p_draw_kernel"),
                         (sampling, "_finalize_kernel"), (staging, "_publish_kernel")]:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), name, keys))
    for module in (ops, linear_ops, staging_layout):  # where the public kernels look their implementation up
        monkeypatch.setattr(module, "implementation", lambda op, device: dispatch.implementation(op, device)
                            if op in SAMPLING_OPS else getattr(reference, op))
    return keys


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Any mix of the fields that reach the sampler."""
    top_k = rng.choice([-1, -1, 1, 2, 3, 7, 20, 50, 64, 65, 100, 200, 255, 256, 257, 1000, vocab - 1, vocab])
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_k=top_k,
                          top_p=rng.choice([1.0, 1.0, 0.05, 0.5, 0.95]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
                          logprobs=rng.choice([None, None, 0, 3, 20]), seed=rng.choice([None, 7]),
                          max_tokens=rng.randint(1, 3), ignore_eos=True)


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    """Dummy weights with over 32 x kernels.sampling.SELECT tokens, where the scan keeps tile
    maxima and the tile depends on top-k."""
    path = tmp_path_factory.mktemp("big_vocab")
    config = json.loads((Path(nanovllm.__file__).parent / "configs" / "qwen3-tiny" / "config.json").read_text())
    config.update(vocab_size=33_000, hidden_size=64, intermediate_size=64, num_hidden_layers=1, head_dim=16)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.triton_interpret
@pytest.mark.parametrize("model, alone, batches", [("checkpoint", 30, 6), ("big_vocab", 12, 2)])
def test_steps_launch_only_variants_the_warmup_launched(model, alone, batches, launched, tmp_path_factory,
                                                        big_vocab_model):
    """Requests alone (a step's variant is its one row's) and in batches of up to 8 (the rows'
    together), with any sampling parameters."""
    if model == "checkpoint":
        path, engine = build_checkpoint(tmp_path_factory.mktemp("warmup"), arch="qwen3", tied=True), ENGINE
    else:  # the interpreter's scan of 33,000 tokens is slow: fewer steps
        path, engine = big_vocab_model, dict(ENGINE, load_format="dummy")
    llm = LLM(str(path), **engine)
    llm.model_runner._warm_up_sampler()
    warmed, vocab = set(launched), llm.config.hf_config.vocab_size
    launched.clear()
    rng = random.Random(0)
    for size in [1] * alone + [rng.randint(2, 8) for _ in range(batches)]:
        prompts = [[rng.randrange(2, 300) for _ in range(rng.randint(1, 20))] for _ in range(size)]
        llm.generate(prompts, [random_params(rng, vocab) for _ in prompts], use_tqdm=False)
    assert {key[0] for key in launched} == {"_scan_kernel", "_min_p_draw_kernel", "_finalize_kernel",
                                           "_publish_kernel"}
    missed = launched - warmed
    assert not missed, f"steps launched variants the warm-up did not: {sorted(missed)}"


# ---- on a GPU ----
COMPILES_SCRIPT = """
import json, sys
import triton
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
compiled = []
SAMPLING = {"_scan_kernel", "_min_p_draw_kernel", "_finalize_kernel", "_publish_kernel"}

def record(fn, **ignored):
    if fn.name in SAMPLING:
        compiled.append(fn.name)
    return False  # compile as usual

triton.knobs.runtime.jit_cache_hook = record
params = [SamplingParams(max_tokens=6, ignore_eos=True, **fields) for fields in json.loads(sys.argv[3])]
prompts = [[5, 17, 3, 99, 42] * 3, [200, 201], list(range(40, 140))]
for batch in range(0, len(params), 3):  # alone, and three together
    for p in params[batch:batch + 3]:
        llm.generate([prompts[0]], p, use_tqdm=False)
    llm.generate(prompts, params[batch:batch + 3], use_tqdm=False)
print(json.dumps(compiled))
"""
REQUESTS = [dict(temperature=0), dict(temperature=0.7, seed=1), dict(top_k=20, top_p=0.95), dict(top_k=50),
            dict(top_k=1), dict(top_p=0.9), dict(top_k=300), dict(min_p=0.1), dict(min_p=0.05, top_k=8, logprobs=2),
            dict(logprobs=0), dict(temperature=0, logprobs=20, top_k=200), dict(top_k=129, min_p=0.2, seed=5)]


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_requests_after_start_compile_no_sampling_kernel(tmp_path_factory, enforce_eager):
    """In a fresh process (a Triton kernel compiles once a process; its cache on disk only
    shortens the compile), every compile of a sampling kernel after LLM() is a request's."""
    path = build_checkpoint(tmp_path_factory.mktemp("gpu_warmup"), arch="qwen3", tied=True)
    engine = dict(device="cuda", dtype="bfloat16", max_model_len=512, kvcache_block_size=16,
                  num_kvcache_blocks=256, max_num_batched_tokens=128, enforce_eager=enforce_eager)
    done = subprocess.run([sys.executable, "-c", COMPILES_SCRIPT, str(path), json.dumps(engine),
                           json.dumps(REQUESTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
