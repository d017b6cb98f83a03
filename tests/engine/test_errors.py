"""Bad input raises ValueError naming the offending field, before any work is queued, and
leaves the engine serving."""

import re

import numpy as np
import pytest
import torch

from checkpoints import VOCAB_SIZE, copy_checkpoint, edit_config, edit_weights

MAX_MODEL_LEN = 64

# name -> (prompts, SamplingParams kwargs, field the message must name)
BAD_REQUESTS = {
    "prompt_too_long": ([list(range(2, 3 + MAX_MODEL_LEN))], {}, "prompt"),
    "prompt_of_max_model_len": ([list(range(2, 2 + MAX_MODEL_LEN))], {}, "prompt"),  # no room for output
    "prompts_3d_array": (np.zeros((1, 1, 4), dtype=np.int64), {}, "prompts"),
    "empty_string": ([""], {}, "prompt"),
    "empty_ids": ([[]], {}, "prompt"),
    "id_past_vocab": ([[5, VOCAB_SIZE]], {}, "prompt"),
    "id_negative": ([[5, -1]], {}, "prompt"),
    "max_tokens_zero": (["Hi"], {"max_tokens": 0}, "max_tokens"),
    "temperature_negative": (["Hi"], {"temperature": -0.5}, "temperature"),
    "top_p_zero": (["Hi"], {"top_p": 0.0}, "top_p"),
    "top_p_above_one": (["Hi"], {"top_p": 1.5}, "top_p"),
    "top_k_zero": (["Hi"], {"top_k": 0}, "top_k"),
    "top_k_below_minus_one": (["Hi"], {"top_k": -2}, "top_k"),
    "top_k_past_int64": (["Hi"], {"top_k": 2**63}, "top_k"),  # the sampler's top-k tensor is int64
    "temperature_string": (["Hi"], {"temperature": "1"}, "temperature"),
    "max_tokens_bool": (["Hi"], {"max_tokens": True}, "max_tokens"),
    "min_p_above_one": (["Hi"], {"min_p": 1.5}, "min_p"),
    "stop_token_ids_bare_int": (["Hi"], {"stop_token_ids": 5}, "stop_token_ids"),
    "stop_token_ids_negative": (["Hi"], {"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop_token_ids_past_vocab": (["Hi"], {"stop_token_ids": [3, VOCAB_SIZE]}, "stop_token_ids"),
    "seed_string": (["Hi"], {"seed": "x"}, "seed"),
    "logprobs_above_20": (["Hi"], {"logprobs": 21}, "logprobs"),
    "logprobs_negative": (["Hi"], {"logprobs": -1}, "logprobs"),
    "logprobs_bool": (["Hi"], {"logprobs": True}, "logprobs"),
    "presence_penalty_above_two": (["Hi"], {"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty_nan": (["Hi"], {"frequency_penalty": float("nan")}, "frequency_penalty"),
    "repetition_penalty_zero": (["Hi"], {"repetition_penalty": 0.0}, "repetition_penalty"),
    "logit_bias_past_vocab": (["Hi"], {"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
    "logit_bias_above_100": (["Hi"], {"logit_bias": {3: 101}}, "logit_bias"),
    "logit_bias_list": (["Hi"], {"logit_bias": [3]}, "logit_bias"),
    "min_tokens_negative": (["Hi"], {"min_tokens": -1}, "min_tokens"),
    "bad_words_string": (["Hi"], {"bad_words": "fox"}, "bad_words"),
}

GOOD_PROMPTS = ["The quick brown fox", "Numbers such as one, two"]


@pytest.fixture(scope="module")
def llm(checkpoint, new_llm):
    return new_llm(checkpoint("qwen3_tied"), max_model_len=MAX_MODEL_LEN)


def submit_bad(llm, name):
    """Build and submit a bad request; SamplingParams may reject its arguments itself, so the
    construction is part of what must raise."""
    from nanovllm import SamplingParams

    prompts, params, field = BAD_REQUESTS[name]
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def assert_serves_correctly(llm, reference, greedy):
    """The engine is idle and still generates exactly the reference, and nothing left over
    from a rejected request comes out with it."""
    assert llm.is_finished()
    assert llm.memory_stats()["kv_blocks_used"] == 0
    outs = llm.generate(GOOD_PROMPTS, greedy(6), use_tqdm=False)
    ref = reference("qwen3_tied")
    assert [o["token_ids"] for o in outs] == [ref(p, 6) for p in GOOD_PROMPTS]


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_raises_value_error_naming_field(name, llm):
    submit_bad(llm, name)


def test_engine_serves_after_every_error(llm, reference, greedy):
    for name in BAD_REQUESTS:
        submit_bad(llm, name)
    assert_serves_correctly(llm, reference, greedy)


@pytest.mark.parametrize("bad_position", [0, 2])
def test_batch_with_one_bad_prompt_queues_nothing(bad_position, llm, reference, greedy):
    prompts = list(GOOD_PROMPTS)
    prompts.insert(bad_position, [5, VOCAB_SIZE + 3])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, greedy(6), use_tqdm=False)
    assert_serves_correctly(llm, reference, greedy)


def test_batch_with_one_bad_sampling_params_queues_nothing(llm, reference, greedy):
    from nanovllm import SamplingParams

    with pytest.raises(ValueError, match="max_tokens"):
        params = [greedy(6), greedy(6), SamplingParams(max_tokens=0)]
        llm.generate(GOOD_PROMPTS + ["Hi"], params, use_tqdm=False)
    assert_serves_correctly(llm, reference, greedy)


def test_bad_online_request_queues_nothing(llm, reference, greedy):
    with pytest.raises(ValueError, match="prompt"):
        llm.add_request([], greedy(6))
    with pytest.raises(ValueError, match="prompt"):
        llm.add_request("x" * 400, greedy(6))  # far more tokens than MAX_MODEL_LEN
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.add_request("Hi", greedy(6, stop_token_ids=[VOCAB_SIZE + 5]))
    assert_serves_correctly(llm, reference, greedy)


def test_huge_legal_integers_run_as_their_meaning(llm, reference, greedy, monkeypatch):
    """top_k up to 2**63 - 1 reaches the sampler as no top-k: the same tokens as top_k=-1, and
    no top-k tensor (whose int64 2**62 would also send each step through a sort). max_tokens
    and seed take any size: one is compared on the host, the other hashed."""
    from nanovllm import SamplingParams, kernels

    sample, sent = kernels.sample, []

    def recording_sample(logits, temperatures, seeds, top_ks=None, *args, **kwargs):
        sent.append(top_ks)
        return sample(logits, temperatures, seeds, top_ks, *args, **kwargs)

    monkeypatch.setattr(kernels, "sample", recording_sample)
    prompt = reference("qwen3_tied").ids(GOOD_PROMPTS[0])
    params = [SamplingParams(max_tokens=2**70, seed=-(2**70), ignore_eos=True, top_k=k)
              for k in (-1, VOCAB_SIZE, 2**62, 2**63 - 1)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert sent and all(top_ks is None for top_ks in sent)
    assert all(out["token_ids"] == outs[0]["token_ids"] for out in outs)
    assert outs[0]["finish_reason"] == "length" and len(prompt) + len(outs[0]["token_ids"]) == MAX_MODEL_LEN
    assert_serves_correctly(llm, reference, greedy)


def test_sampling_params_bound_top_k_by_int64():
    from nanovllm import SamplingParams
    from nanovllm.sampling_params import MAX_TOP_K

    assert MAX_TOP_K == torch.iinfo(torch.int64).max
    assert SamplingParams(top_k=MAX_TOP_K).top_k == MAX_TOP_K
    for top_k in (MAX_TOP_K + 1, np.uint64(2**63), 10**30):
        with pytest.raises(ValueError) as err:
            SamplingParams(top_k=top_k)
        assert str(err.value).startswith("top_k: ")


# ---- model folder errors: raised by the constructor ----


@pytest.fixture
def scratch(tmp_path_factory):
    # tmp_path would embed the test's name (which contains "model") in the path, so a message
    # quoting the path would satisfy match="model" by accident.
    return tmp_path_factory.mktemp("ckpt")


def test_missing_model_folder(scratch, new_llm):
    with pytest.raises(ValueError, match="model"):
        new_llm(scratch / "absent")


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_model_folder_lacking_file(missing, scratch, checkpoint, new_llm):
    path = copy_checkpoint(checkpoint("qwen3_tied"), scratch / "c", skip=(missing,))
    with pytest.raises(ValueError, match="model"):
        new_llm(path)


def test_unknown_architecture_names_supported_ones(scratch, checkpoint, new_llm):
    path = copy_checkpoint(checkpoint("qwen3_tied"), scratch / "c")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        new_llm(path)
    assert "Qwen3ForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


# (checkpoint, tensor, how to break it). down_proj is not fused with another projection, so
# the engine has no reason to report it under a different name.
BROKEN_WEIGHTS = {
    "missing": ("qwen3_tied", "model.layers.1.mlp.down_proj.weight", lambda t, k: t.pop(k)),
    "missing_untied_head": ("qwen3_untied", "lm_head.weight", lambda t, k: t.pop(k)),
    "unexpected": (
        "qwen3_tied",
        "model.layers.0.mlp.extra_proj.weight",
        lambda t, k: t.__setitem__(k, torch.zeros(4, 4)),
    ),
    "wrong_shape": (
        "qwen3_tied",
        "model.norm.weight",
        lambda t, k: t.__setitem__(k, torch.ones(t[k].numel() + 1)),
    ),
}


@pytest.mark.parametrize("case", BROKEN_WEIGHTS)
def test_broken_weights_name_the_tensor(case, scratch, checkpoint, new_llm):
    name, tensor, breaker = BROKEN_WEIGHTS[case]
    path = copy_checkpoint(checkpoint(name), scratch / "c")
    edit_weights(path, lambda tensors: breaker(tensors, tensor))
    with pytest.raises(ValueError, match=re.escape(tensor)):
        new_llm(path)
