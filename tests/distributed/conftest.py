"""Fixtures for the tensor- and data-parallel tests."""
import pytest
import torch

from checkpoints import build_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    """Worker processes take their parent's torch thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", tied=True)
