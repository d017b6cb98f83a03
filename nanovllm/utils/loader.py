"""Fills a model's parameters from safetensors files (single or sharded), a GGUF file
(nanovllm.utils.gguf), or with random values for load_format="dummy". Pickled checkpoints are
never read."""
import glob
import json
import math
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.utils.gguf import gguf_tensors, is_gguf


# An attention layer's FP8 KV-cache scale as HF and vLLM checkpoints name it: no parameter of
# the model, the model runner reads it (kv_cache_scales).
_KV_SCALE_NAME = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """The weight_loader of parameters that take a checkpoint tensor whole."""
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match the model's {tuple(param.shape)}")
    param.data.copy_(loaded)


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


def checkpoint_names(model: nn.Module, remove_duplicate: bool = True) -> dict[str, tuple[str, object]]:
    """Checkpoint tensor name -> (model parameter, shard id) for every tensor the model takes.
    Merged parameters (qkv_proj, gate_up_proj) take one tensor per shard."""
    pieces = {}
    for fragment, (merged, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        pieces.setdefault(merged, []).append((fragment, shard_id))
    names = {}
    for param_name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        # stacked parameters (a MoE layer's experts) name their checkpoint tensors themselves
        if shards := getattr(param, "checkpoint_shards", None):
            module = param_name.rpartition(".")[0]
            names.update({f"{module}.{suffix}": (param_name, shard_id) for suffix, shard_id in shards.items()})
            continue
        merged = next((m for m in pieces if f".{m}." in param_name), None)
        for fragment, shard_id in pieces.get(merged, [(None, None)]):
            source = param_name.replace(f".{merged}.", f".{fragment}.") if merged else param_name
            names[source] = (param_name, shard_id)
    return names


def safetensors_tensors(model_dir: str):
    """(name, tensor) for every tensor of the folder's safetensors files."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model: nn.Module, model_path: str) -> None:
    """Errors name the checkpoint tensor: missing, unexpected or of the wrong shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # Tied parameters appear once in `required` but may also come under their other names.
    accepted, required = checkpoint_names(model, remove_duplicate=False), set(checkpoint_names(model))
    loaded = set()
    tensors = gguf_tensors(model_path, accepted) if is_gguf(model_path) else safetensors_tensors(model_path)
    for name, tensor in tensors:
        if name not in accepted:
            if _KV_SCALE_NAME.search(name):
                continue
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
        param_name, shard_id = accepted[name]
        _load_one(params[param_name], tensor, name, shard_id)
        loaded.add(name)
    missing = sorted(required - loaded - _aliases_of(model, loaded, accepted))
    if missing:
        raise ValueError(f"model: checkpoint lacks tensor(s) {', '.join(missing[:8])}")


def kv_cache_scales(model_dir: str) -> dict[int, dict[str, float]]:
    """Decoder layer index -> {"k": k_scale, "v": v_scale} of the checkpoint's per-tensor KV
    scales (model.layers.N.self_attn.k_scale), as far as it has them; a GGUF file has none."""
    scales = {}
    if is_gguf(model_dir):
        return scales
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                match = _KV_SCALE_NAME.search(name)
                if not match:
                    continue
                tensor = f.get_tensor(name)
                value = float(tensor.float().flatten()[0]) if tensor.numel() == 1 else math.nan
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"model: checkpoint tensor {name!r} must be one positive finite scale, "
                                     f"got {tensor.tolist()}")
                scales.setdefault(int(match[1]), {})[match[2]] = value
    return scales


def _load_one(param: nn.Parameter, tensor: torch.Tensor, name: str, shard_id) -> None:
    loader = getattr(param, "weight_loader", copy_checked)
    if shard_id is None:
        loader(param, tensor, name)
    else:
        loader(param, tensor, name, shard_id)


def _aliases_of(model: nn.Module, loaded: set, accepted: dict) -> set:
    """Required names satisfied through a tied parameter loaded under another name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[accepted[name][0]]) for name in loaded if accepted[name][1] is None}
    return {name for name, (param_name, shard) in accepted.items()
            if shard is None and id(params[param_name]) in loaded_ids}


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with the scale of a trained model's, so activations stay finite."""
    generators = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if hasattr(param, "quantize_from"):  # an FP8 weight: its scales come with it
                values = torch.empty(param.shape, dtype=param.compute_dtype, device=param.device)
                param.quantize_from(values.normal_(0.0, 0.02, generator=_generator(generators, param.device, seed)))
                continue
            if name.endswith("weight_scale_inv"):
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            param.normal_(0.0, 0.02, generator=_generator(generators, param.device, seed))


def _generator(generators: dict, device: torch.device, seed: int) -> torch.Generator:
    if device not in generators:
        generators[device] = torch.Generator(device=device).manual_seed(seed)
    return generators[device]
