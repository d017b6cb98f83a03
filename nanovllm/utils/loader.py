"""Fills a model's parameters from safetensors files (single or sharded), or with random
values for load_format="dummy". Pickled checkpoints are never read."""
import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import copy_checked


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir!r} (pickled checkpoints are not loaded)")
    return files


def _target(model: nn.Module, name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills, and its shard id in a merged parameter."""
    for fragment, (merged, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), shard_id
    return name, None


def load_model(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {(name, shard) for name, shard in _expected_pieces(model, params)}
    loaded = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                target, shard_id = _target(model, name)
                if target not in params:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
                _load_one(params[target], f.get_tensor(name), name, shard_id)
                loaded.add((target, shard_id))
    missing = expected - loaded - _tied_pieces(model, loaded)
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"model: checkpoint lacks tensors for {', '.join(names[:8])}")


def _load_one(param: nn.Parameter, tensor: torch.Tensor, name: str, shard_id) -> None:
    loader = getattr(param, "weight_loader", copy_checked)
    if shard_id is None:
        loader(param, tensor, name)
    else:
        loader(param, tensor, name, shard_id)


def _expected_pieces(model: nn.Module, params: dict):
    """Every (parameter, shard) a complete checkpoint must provide."""
    merged = {}
    for merged_name, shard_id in getattr(model, "packed_modules_mapping", {}).values():
        merged.setdefault(merged_name, []).append(shard_id)
    for name in params:
        shards = next((ids for m, ids in merged.items() if f".{m}." in name), [None])
        yield from ((name, shard) for shard in shards)


def _tied_pieces(model: nn.Module, loaded: set) -> set:
    """Parameters shared with one that was loaded count as loaded (tied embeddings)."""
    by_identity = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    tied = set()
    for names in by_identity.values():
        if any((n, None) in loaded for n in names):
            tied.update((n, None) for n in names)
    return tied


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with the scale of a trained model's, so activations stay finite."""
    generators = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])
