"""A request's prompt as the engine takes it: generate()'s arguments split into single prompts
and their SamplingParams, and one prompt's token ids (a string tokenized, token ids, or a 1-D
integer array or tensor), checked against the model's vocabulary and max_model_len."""
import operator

import numpy as np
import torch

from nanovllm.config import Config


def prompt_token_ids(prompt, tokenizer, config: Config) -> list[int]:
    """The prompt's token ids; a ValueError naming `prompt` for one the model cannot take."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model folder has no tokenizer; pass token ids")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (np.ndarray, torch.Tensor)):
        if prompt.ndim != 1 or not _integer_array(prompt):
            raise ValueError(f"prompt: an array of token ids must be 1-D and integer, "
                             f"got shape {tuple(prompt.shape)} of {prompt.dtype}")
        token_ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)):
        token_ids = [_as_int(t) for t in prompt]
    else:
        raise ValueError(f"prompt: expected a string or token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt: is empty")
    vocab = config.hf_config.vocab_size
    if not all(0 <= t < vocab for t in token_ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
    if len(token_ids) >= config.max_model_len:
        raise ValueError(f"prompt: {len(token_ids)} tokens leave no room for any output under "
                         f"max_model_len={config.max_model_len} (prompt + output <= max_model_len)")
    return token_ids


def split_requests(prompts, sampling_params) -> tuple[list, list]:
    """generate()'s arguments as a list of single prompts and a list of their SamplingParams."""
    prompts = split_prompts(prompts)
    if not isinstance(sampling_params, list):
        return prompts, [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError("sampling_params: needs one entry per prompt")
    return prompts, sampling_params


def split_prompts(prompts) -> list:
    """generate()'s `prompts` as a list of single prompts. One prompt is a string, a list of
    token ids or a 1-D integer array or tensor; a batch is a non-empty list of prompts or a 2-D
    integer array or tensor (a prompt per row)."""
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        batch = [prompts] if prompts.ndim == 1 else list(prompts) if prompts.ndim == 2 else None
    elif isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and prompts and all(map(_is_token_id, prompts)):
        batch = [prompts]
    else:
        batch = prompts
    if not isinstance(batch, (list, tuple)) or not batch or not all(map(_is_prompt, batch)):
        raise ValueError("prompts: expected a prompt (a string, token ids, a 1-D integer array or tensor), "
                         "a non-empty list of prompts or a 2-D integer array or tensor")
    return list(batch)


def _integer_array(array) -> bool:
    if isinstance(array, torch.Tensor):
        return not (array.dtype.is_floating_point or array.dtype.is_complex or array.dtype == torch.bool)
    return np.issubdtype(array.dtype, np.integer)


def _is_token_id(token) -> bool:
    """Any integer (Python, numpy, a 0-d array or tensor) but a bool."""
    if isinstance(token, bool) or getattr(token, "ndim", 0):  # torch.tensor([3]) has an __index__
        return False
    try:
        operator.index(token)
    except TypeError:
        return False
    return True


def _is_prompt(prompt) -> bool:
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return prompt.ndim == 1 and _integer_array(prompt)
    return isinstance(prompt, (str, list, tuple))


def _as_int(token) -> int:
    if not _is_token_id(token):
        raise ValueError(f"prompt: token ids must be integers, got {token!r}")
    return operator.index(token)
