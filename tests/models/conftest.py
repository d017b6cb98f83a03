"""Tiny checkpoints of every family and rope scaling type (FAMILY_CHECKPOINTS), with the
engine-test machinery of tests/engine/conftest.py: the transformers greedy reference, engine
and prompt builders."""
import functools

import pytest
import torch

from checkpoints import FAMILY_CHECKPOINTS, build_checkpoint
from engine.conftest import GreedyReference, greedy, new_llm, random_ids  # noqa: F401
from nanovllm.utils.context import reset_context, set_context


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family_checkpoint(name) -> folder of that entry of FAMILY_CHECKPOINTS, built once per session."""
    return functools.cache(lambda name: build_checkpoint(tmp_path_factory.mktemp(name), **FAMILY_CHECKPOINTS[name]))


@pytest.fixture(scope="session")
def family_reference(family_checkpoint):
    """family_reference(name) -> GreedyReference for that checkpoint, loaded once per session."""
    return functools.cache(lambda name: GreedyReference(family_checkpoint(name)))


@torch.inference_mode()
def engine_logits(llm, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position of `ids`, computed chunk by chunk as the engine's steps do: each
    chunk's keys and values go to the paged cache (blocks 0, 1, ... of an idle engine), where
    the later chunks read them."""
    runner = llm.model_runner
    on = dict(device=runner.device)
    blocks = torch.arange(-(-len(ids) // runner.block_size), dtype=torch.int32, **on)[None]
    logits, start = [], 0
    for size in chunks:
        end = start + size
        set_context(cu_seqlens_q=torch.tensor([0, size], dtype=torch.int32, **on),
                    seq_lens=torch.tensor([end], dtype=torch.int32, **on), block_tables=blocks,
                    slot_mapping=torch.arange(start, end, **on), max_seqlen_q=size)
        try:
            hidden = runner.model(torch.tensor(ids[start:end], **on), torch.arange(start, end, **on))
        finally:
            reset_context()
        logits.append(runner.model.compute_logits(hidden))
        start = end
    return torch.cat(logits)
