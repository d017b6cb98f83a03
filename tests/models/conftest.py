"""Tiny checkpoints of every family and rope scaling type (FAMILY_CHECKPOINTS), with the
engine-test machinery of tests/engine/conftest.py: the transformers greedy reference, engine
and prompt builders."""
import functools

import pytest

from checkpoints import FAMILY_CHECKPOINTS, build_checkpoint
from engine.conftest import GreedyReference, greedy, new_llm, random_ids  # noqa: F401


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family_checkpoint(name) -> folder of that entry of FAMILY_CHECKPOINTS, built once per session."""
    return functools.cache(lambda name: build_checkpoint(tmp_path_factory.mktemp(name), **FAMILY_CHECKPOINTS[name]))


@pytest.fixture(scope="session")
def family_reference(family_checkpoint):
    """family_reference(name) -> GreedyReference for that checkpoint, loaded once per session."""
    return functools.cache(lambda name: GreedyReference(family_checkpoint(name)))
