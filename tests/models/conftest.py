"""Tiny checkpoints of every family and rope scaling type (FAMILY_CHECKPOINTS), with the
engine-test machinery of tests/engine/conftest.py: the transformers greedy reference, engine
and prompt builders."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import FAMILY_CHECKPOINTS, build_checkpoint  # noqa: E402
from engine.conftest import GreedyReference, greedy, new_llm, random_ids  # noqa: E402, F401


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family_checkpoint(name) -> folder of that entry of FAMILY_CHECKPOINTS, built once per session."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), **FAMILY_CHECKPOINTS[name])
        return built[name]

    return get


@pytest.fixture(scope="session")
def family_reference(family_checkpoint):
    """family_reference(name) -> GreedyReference for that checkpoint, loaded once per session."""
    refs = {}

    def get(name: str) -> GreedyReference:
        if name not in refs:
            refs[name] = GreedyReference(family_checkpoint(name))
        return refs[name]

    return get
