import os

import pytest
import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    """GPU tests need CUDA; interpreter tests need TRITON_INTERPRET=1 set before triton is
    imported, so they run in their own pytest invocation (see scripts/test.sh)."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (second pytest run of scripts/test.sh)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "triton_interpret" in item.keywords and not INTERPRETER:
            item.add_marker(skip_interp)
