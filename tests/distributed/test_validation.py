"""Parallel sizes the model or the machine cannot take are ValueErrors naming the argument,
raised before any process starts."""
import pytest
import torch

from checkpoints import copy_checkpoint, edit_config
from parallel_testing import ENGINE, child_pids
from nanovllm import LLM

# The tiny checkpoint: 4 query heads, 2 key/value heads, intermediate size 128.
BAD_SIZES = {
    "heads": (dict(tensor_parallel_size=3), "tensor_parallel_size: 3 does not divide the model's num_attention_heads"),
    "kv_heads": (dict(tensor_parallel_size=4),
                 "tensor_parallel_size: 4 does not divide the model's num_key_value_heads"),
    "tp_zero": (dict(tensor_parallel_size=0), "tensor_parallel_size: must be at least 1"),
    "dp_zero": (dict(data_parallel_size=0), "data_parallel_size: must be at least 1"),
}


@pytest.mark.parametrize("name", BAD_SIZES)
def test_sizes_the_model_cannot_split(checkpoint, name):
    args, message = BAD_SIZES[name]
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint), **{**ENGINE, **args})
    assert not child_pids()


def test_intermediate_size_must_split(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path / "wide_kv")
    edit_config(path, num_key_value_heads=4, intermediate_size=130)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the model's intermediate_size"):
        LLM(str(path), **{**ENGINE, "tensor_parallel_size": 4})


@pytest.mark.parametrize("args, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size: 2 ranks on this machine need a GPU each, 1 visible"),
    (dict(data_parallel_size=2, tensor_parallel_size=2), "data_parallel_size: 4 ranks on this machine need a GPU"),
    (dict(tensor_parallel_size=2, device="cuda:0"), "device: 'cuda:0' names one GPU"),
], ids=["tp", "dp", "device_index"])
def test_more_ranks_than_gpus(checkpoint, monkeypatch, args, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint), **{**ENGINE, "device": "cuda", **args})
    assert not child_pids()


def test_torchrun_world_must_be_the_engines_ranks(checkpoint, monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: under torchrun it must equal WORLD_SIZE \(4\)"):
        LLM(str(checkpoint), **{**ENGINE, "tensor_parallel_size": 2})
