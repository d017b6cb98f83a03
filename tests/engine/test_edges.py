"""Edges of the engine API: near-zero temperatures, array prompts, strict SamplingParams
types, the max_model_len boundary, streaming through step() (pipelined, and while generate()
runs) and the checkpoint's sampling defaults."""
import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from checkpoints import copy_checkpoint
from nanovllm import SamplingParams, kernels
from nanovllm.engine.sampled_tokens import SampledTokens
from nanovllm.engine.sampling_inputs import SamplingInputs
from nanovllm.sampling_params import GREEDY_TEMPERATURE

IDS_A = [5, 17, 3, 99, 42, 7]
IDS_B = [200, 201, 33, 61, 9, 120]  # as long as IDS_A: the two make a 2-D array
MAX_STEPS = 2000  # bounds step loops, so an engine that never finishes fails


def token_ids(outs):
    return [o["token_ids"] for o in outs]


def stream(llm, streams=None) -> dict[int, list[dict]]:
    """Steps until idle; every output of each request, in the order step() returned them."""
    streams = {} if streams is None else streams
    for _ in range(MAX_STEPS):
        if llm.is_finished():
            return streams
        for out in llm.step():
            streams.setdefault(out["request_id"], []).append(out)
    raise AssertionError(f"engine not finished after {MAX_STEPS} steps")


def assert_streamed_exactly(outs: list[dict], expected: list[int]) -> None:
    """One output per token, in order, the last one final: nothing lost or repeated."""
    assert [o["new_token_id"] for o in outs] == expected
    assert [o["token_ids"] for o in outs] == [expected[:n] for n in range(1, len(expected) + 1)]
    assert [o["finished"] for o in outs] == [False] * (len(expected) - 1) + [True]


# ---- near-zero temperatures sample greedily on every path ----


@pytest.mark.parametrize("filters", [{}, {"top_k": 20}, {"top_p": 0.9}], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("temperature", [1e-40, 0.5 * GREEDY_TEMPERATURE])
def test_tiny_temperature_is_greedy(llm, ref, temperature, filters):
    # fp32 logits / 1e-40 overflow to inf: without the threshold every positive logit ties.
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, **filters)
    # Seeded temperature-1 neighbours keep the batch's sampling path a real draw.
    outs = llm.generate([IDS_A, IDS_B, IDS_A], [params, params, SamplingParams(seed=1, max_tokens=6)],
                        use_tqdm=False)
    assert token_ids(outs[:2]) == [ref(IDS_A, 6), ref(IDS_B, 6)]


def test_temperatures_below_the_threshold_reach_the_sampler_as_zero(llm):
    temperatures = [0.0, 1e-40, 0.999 * GREEDY_TEMPERATURE, GREEDY_TEMPERATURE, 0.7]
    seqs = [SimpleNamespace(params=SamplingParams(temperature=t), num_output_tokens=0) for t in temperatures]
    runner = llm.model_runner
    sampling = SamplingInputs(seqs, llm.config.hf_config.vocab_size, random.Random(0))
    sent = sampling.tensors(runner._to_device)["temperatures"].tolist()
    assert sent[:3] == [0.0, 0.0, 0.0]
    assert sent[3:] == pytest.approx(temperatures[3:], rel=1e-6)  # fp32 rounding of the values


@pytest.mark.triton_interpret
def test_tiny_temperature_is_greedy_in_the_triton_sampler(checkpoint, ref, new_llm):
    assert kernels.backend_for("cpu") == "triton", "the Triton path silently fell back to PyTorch"
    llm = new_llm(checkpoint("qwen3_tied"))
    outs = llm.generate([IDS_A, IDS_B], SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert token_ids(outs) == [ref(IDS_A, 4), ref(IDS_B, 4)]


# ---- array prompts ----

ARRAY_MAKERS = {
    "numpy": np.array,
    "numpy_int32": lambda ids: np.array(ids, dtype=np.int32),
    "torch": torch.tensor,
    "torch_int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
}


@pytest.mark.parametrize("kind", ARRAY_MAKERS)
def test_array_prompts(kind, llm, ref, greedy):
    make = ARRAY_MAKERS[kind]
    a, b = ref(IDS_A, 3), ref(IDS_B, 3)
    assert token_ids(llm.generate(make(IDS_A), greedy(3), use_tqdm=False)) == [a]
    assert token_ids(llm.generate([make(IDS_A), make(IDS_B)], greedy(3), use_tqdm=False)) == [a, b]
    assert token_ids(llm.generate(make([IDS_A, IDS_B]), greedy(3), use_tqdm=False)) == [a, b]
    assert token_ids(llm.generate((make(IDS_B), IDS_A), greedy(3), use_tqdm=False)) == [b, a]
    # One-token arrays in a list are prompts, not token ids.
    singles = [IDS_A[:1], IDS_B[:1]]
    assert token_ids(llm.generate([make(p) for p in singles], greedy(3), use_tqdm=False)) == [ref(p, 3) for p in singles]
    request = llm.add_request(make(IDS_B), greedy(3))
    assert stream(llm)[request][-1]["token_ids"] == b


def test_token_ids_of_numpy_integer_type_are_one_prompt(llm, ref, greedy):
    outs = llm.generate([np.int64(t) for t in IDS_A], greedy(3), use_tqdm=False)
    assert token_ids(outs) == [ref(IDS_A, 3)]


BAD_PROMPTS = {
    "array_3d": np.zeros((1, 2, 3), dtype=np.int64),
    "array_0d": np.array(5),
    "float_array": np.array([1.0, 2.0]),
    "float_tensor": torch.tensor([1.0, 2.0]),
    "bool_tensor": torch.tensor([True, False]),
    "empty_batch": [],
    "empty_2d_array": np.zeros((0, 4), dtype=np.int64),
    "ids_and_text": [1, "a"],
    "ids_and_lists": [[1, 2], 3],
    "batch_with_2d_array": [np.array([[1, 2]])],
    "batch_with_float_array": [np.array([1, 2]), np.array([1.5])],
    "bools": [True, False],
    "ids_and_tensors": [3, torch.tensor([4])],
    "none": None,
    "int": 5,
    "dict": {"prompt": [1, 2]},
}


@pytest.mark.parametrize("name", BAD_PROMPTS)
def test_bad_prompts_raise_naming_prompts(name, llm, greedy):
    with pytest.raises(ValueError, match=r"^prompts: "):
        llm.generate(BAD_PROMPTS[name], greedy(3), use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("prompt", [np.array([[1, 2]]), np.array([1.5]), torch.tensor([True]), 7, None, [1, True]],
                         ids=["2d", "float", "bool", "int", "none", "bool_id"])
def test_bad_online_prompt_raises_naming_prompt(prompt, llm, greedy):
    with pytest.raises(ValueError, match=r"^prompt: "):
        llm.add_request(prompt, greedy(3))
    assert llm.is_finished()


# ---- SamplingParams: every field's type and range ----

# (field, bad value)
BAD_SAMPLING_PARAMS = [
    ("temperature", "1"), ("temperature", True), ("temperature", None), ("temperature", -0.5),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", 1 + 0j),
    ("top_k", 1.0), ("top_k", True), ("top_k", "5"), ("top_k", 0), ("top_k", -2), ("top_k", None),
    ("top_p", True), ("top_p", "0.9"), ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", -0.1),
    ("min_p", True), ("min_p", "0.1"), ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", None),
    ("max_tokens", True), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 8.0), ("max_tokens", "8"),
    ("max_tokens", None),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("stop_token_ids", 5), ("stop_token_ids", "12"), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", [1, None]), ("stop_token_ids", {3}),
    ("seed", True), ("seed", "x"), ("seed", 1.5), ("seed", np.float64(2)),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_SAMPLING_PARAMS])
def test_bad_sampling_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(f"{field}: ")


def test_sampling_params_take_integers_for_floats_and_numpy_scalars():
    params = SamplingParams(temperature=1, top_k=np.int64(5), top_p=np.float32(0.5), min_p=0, max_tokens=np.int32(3),
                            ignore_eos=np.bool_(True), stop_token_ids=(np.int64(4), 5), seed=np.uint8(7))
    assert params == SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.0, max_tokens=3, ignore_eos=True,
                                    stop_token_ids=[4, 5], seed=7)
    stored = [params.temperature, params.top_k, params.top_p, params.min_p, params.max_tokens, params.ignore_eos,
              *params.stop_token_ids, params.seed]
    assert [type(v) for v in stored] == [float, int, float, float, int, bool, int, int, int]
    assert SamplingParams(min_p=1).min_p == 1.0 and SamplingParams().min_p == 0.0


# ---- max_model_len: prompt + output <= max_model_len ----

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def short_llm(checkpoint, new_llm):
    return new_llm(checkpoint("qwen3_tied"), max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize(("prompt_len", "max_tokens", "expected"),
                         [(MAX_MODEL_LEN - 1, 10, 1), (MAX_MODEL_LEN - 3, 10, 3), (MAX_MODEL_LEN - 3, 2, 2)])
def test_output_ends_when_the_sequence_reaches_max_model_len(prompt_len, max_tokens, expected, short_llm, ref,
                                                             greedy, random_ids):
    prompt = random_ids(prompt_len, seed=prompt_len)
    (out,) = short_llm.generate([prompt], greedy(max_tokens), use_tqdm=False)
    assert out["token_ids"] == ref(prompt, expected) and out["finish_reason"] == "length"
    request = short_llm.add_request(prompt, greedy(max_tokens))
    (final,) = [o for o in stream(short_llm)[request] if o["finished"]]
    assert final["token_ids"] == ref(prompt, expected) and final["finish_reason"] == "length"


@pytest.mark.parametrize("prompt_len", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1])
def test_prompt_of_max_model_len_or_more_is_rejected(prompt_len, short_llm, greedy, random_ids):
    prompt = random_ids(prompt_len, seed=prompt_len)
    with pytest.raises(ValueError, match=r"^prompt: .*no room for any output"):
        short_llm.generate([prompt], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt: .*no room for any output"):
        short_llm.add_request(prompt, greedy(1))
    assert short_llm.is_finished()


# ---- streaming through step() ----


def test_step_keeps_one_step_in_flight(checkpoint, new_llm, monkeypatch, greedy):
    """Each step() queues the next step on the device before it reads the tokens of the one
    queued before, as generate() does."""
    llm = new_llm(checkpoint("qwen3_tied"))
    events = []
    launch, tolist = llm.model_runner.launch, SampledTokens.tolist
    monkeypatch.setattr(llm.model_runner, "launch", lambda batch: events.append("launch") or launch(batch))
    monkeypatch.setattr(SampledTokens, "tolist", lambda self: events.append("read") or tolist(self))
    llm.add_request(IDS_A, greedy(4))
    per_call, outputs = [], []
    while not llm.is_finished():
        events.clear()
        outputs.append([o["new_token_id"] for o in llm.step()])
        per_call.append(list(events))
    # The fourth token ends the request by length: nothing is launched after it.
    assert per_call == [["launch"], ["launch", "read"], ["launch", "read"], ["launch", "read"], ["read"]]
    assert outputs == [[], *([t] for t in llm.generate([IDS_A], greedy(4), use_tqdm=False)[0]["token_ids"])]


def test_streamed_tokens_arrive_in_order_exactly_once(llm, ref, greedy):
    lengths = {0: 9, 1: 4, 2: 12}
    prompts = [IDS_A, IDS_B, [7, 8, 9]]
    requests = {llm.add_request(prompts[i], greedy(n)): i for i, n in lengths.items()}
    streams = stream(llm)
    for request, i in requests.items():
        assert_streamed_exactly(streams[request], ref(prompts[i], lengths[i]))


def test_online_tokens_produced_inside_generate_reach_step(llm, ref, greedy):
    online = llm.add_request(IDS_A, greedy(10))
    streams = {}
    for out in llm.step() + llm.step():
        streams.setdefault(out["request_id"], []).append(out)
    # generate() runs the online request alongside its own; its tokens wait for step().
    assert token_ids(llm.generate([IDS_B], greedy(4), use_tqdm=False)) == [ref(IDS_B, 4)]
    stream(llm, streams)
    assert set(streams) == {online}
    assert_streamed_exactly(streams[online], ref(IDS_A, 10))


def test_abort_between_pipelined_steps_drops_the_token_in_flight(llm, ref, greedy):
    aborted = llm.add_request(IDS_A, greedy(20))
    kept = llm.add_request(IDS_B, greedy(6))
    streams = {}
    for _ in range(3):
        for out in llm.step():
            streams.setdefault(out["request_id"], []).append(out)
    assert len(streams[aborted]) == 2  # a third token is in flight
    assert llm.abort(aborted) and not llm.abort(aborted)
    stream(llm, streams)
    assert len(streams[aborted]) == 2
    assert_streamed_exactly(streams[kept], ref(IDS_B, 6))
    assert llm.memory_stats()["kv_blocks_used"] == 0


# ---- the checkpoint's sampling defaults (generation_config.json) ----


def checkpoint_with_generation_config(checkpoint, tmp_path, **fields):
    path = copy_checkpoint(checkpoint("qwen3_tied"), tmp_path / "ckpt")
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))
    return path


RECOMMENDED = dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)


def test_sampling_defaults_read_from_generation_config(checkpoint, tmp_path, new_llm):
    path = checkpoint_with_generation_config(checkpoint, tmp_path, do_sample=True, repetition_penalty=1.1,
                                             max_new_tokens=5, **RECOMMENDED)
    assert new_llm(path).sampling_defaults == RECOMMENDED
    assert new_llm(path, generation_config="none").sampling_defaults == {}
    assert new_llm(checkpoint("qwen3_tied")).sampling_defaults == {}
    path.joinpath("generation_config.json").unlink()
    assert new_llm(path).sampling_defaults == {}


def test_generation_config_top_k_zero_means_off(checkpoint, tmp_path, new_llm):
    path = checkpoint_with_generation_config(checkpoint, tmp_path, top_k=0, top_p=None)
    assert new_llm(path).sampling_defaults == {"top_k": -1}


def test_bad_generation_config(checkpoint, tmp_path, new_llm):
    with pytest.raises(ValueError, match=r"^generation_config: "):
        new_llm(checkpoint("qwen3_tied"), generation_config="vllm")
    path = checkpoint_with_generation_config(checkpoint, tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match=r"^generation_config: .*top_p"):
        new_llm(path)
    assert new_llm(path, generation_config="none").sampling_defaults == {}


def test_requests_without_sampling_params_use_the_defaults(checkpoint, tmp_path, new_llm, ref):
    # Greedy by default: no SamplingParams gives transformers' tokens up to EOS, 64 at most.
    llm = new_llm(checkpoint_with_generation_config(checkpoint, tmp_path, temperature=0.0))
    expected = ref(IDS_A, 64)
    eos = ref.tokenizer.eos_token_id
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    (out,) = llm.generate(IDS_A, use_tqdm=False)
    assert out["token_ids"] in (expected, expected[:-1])
    request = llm.add_request(IDS_A)
    assert stream(llm)[request][-1]["token_ids"] == out["token_ids"]
    # An explicit SamplingParams is taken as given, not merged with the defaults.
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    plain = new_llm(checkpoint("qwen3_tied"))
    (explicit,) = llm.generate(IDS_A, sampled, use_tqdm=False)
    assert explicit["token_ids"] == plain.generate(IDS_A, sampled, use_tqdm=False)[0]["token_ids"]
    assert explicit["token_ids"] != ref(IDS_A, 8), "seed 5 samples the greedy tokens: pick another"


# ---- on a GPU: the Triton sampler and CUDA graphs ----


@pytest.fixture(scope="module")
def gpu_llm(checkpoint, new_llm):
    return new_llm(checkpoint("qwen3_tied"), device="cuda", enforce_eager=False)


@pytest.mark.gpu
def test_tiny_temperature_is_greedy_on_the_gpu(gpu_llm, greedy):
    prompts = [IDS_A, IDS_B, list(range(40, 140))]
    expected = token_ids(gpu_llm.generate(prompts, greedy(8), use_tqdm=False))
    params = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert token_ids(gpu_llm.generate(prompts, params, use_tqdm=False)) == expected


@pytest.mark.gpu
def test_pipelined_step_loop_on_the_gpu(gpu_llm, greedy):
    """Decode inputs come from the step in flight, through CUDA graphs; an abort between
    steps drops its in-flight token and frees its blocks."""
    prompts, lengths = [IDS_A, IDS_B, list(range(40, 140)), [7, 8, 9]], [20, 9, 14, 30]
    expected = token_ids(gpu_llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False))
    requests = [gpu_llm.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
    streams = {}
    for _ in range(4):
        for out in gpu_llm.step():
            streams.setdefault(out["request_id"], []).append(out)
    aborted = requests.pop()
    received = len(streams[aborted])
    assert gpu_llm.abort(aborted)
    stream(gpu_llm, streams)
    assert len(streams[aborted]) == received
    for request, tokens in zip(requests, expected):
        assert_streamed_exactly(streams[request], tokens)
    assert gpu_llm.memory_stats()["kv_blocks_used"] == 0
