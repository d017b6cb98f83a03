"""nanovllm/kernels/dispatch.py: the backend is chosen once per process from the environment,
so each setting is tried in a fresh interpreter."""
import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nanovllm import kernels
from nanovllm.kernels import dispatch

# Reports, as JSON, what the dispatch decided and what calling ops did.
PROBE = textwrap.dedent("""
    import json, warnings
    import torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from nanovllm import kernels
        report = {"available": kernels.KERNELS_AVAILABLE}
        try:
            report["backend"] = kernels.backend_for("cpu")
            x, w = torch.randn(4, 64), torch.randn(64)
            out = kernels.silu_and_mul(x)
            report["silu_ok"] = torch.allclose(out, torch.nn.functional.silu(x[:, :32]) * x[:, 32:], atol=1e-5)
            kernels.rms_norm(x, w, 1e-6)
            kernels.rms_norm(x, w, 1e-6)
            report["rms_norm_still_callable"] = True
        except RuntimeError as exc:
            report["error"] = str(exc)
        except TypeError as exc:
            report["rms_norm_still_callable"] = False
            report["error"] = str(exc)
    report["fallback_warnings"] = sum("PyTorch reference" in str(w.message) for w in caught)
    print(json.dumps(report))
""")


@functools.lru_cache(maxsize=None)
def probe(backend: str | None, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NANOVLLM_KERNEL_BACKEND", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's decision, on any machine
    if backend is not None:
        env["NANOVLLM_KERNEL_BACKEND"] = backend
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_auto_without_triton_falls_back_once_with_one_warning():
    report = probe(None, interpret=False)
    assert report["backend"] == "torch" and not report["available"]
    assert report["silu_ok"] and report["rms_norm_still_callable"]
    assert report["fallback_warnings"] == 1


def test_auto_with_the_interpreter_runs_triton_silently():
    report = probe("auto", interpret=True)
    assert report["backend"] == "triton" and report["available"]
    assert report["silu_ok"]
    assert report["fallback_warnings"] == 0


def test_public_rms_norm_survives_its_triton_module_import():
    assert probe("auto", interpret=True)["rms_norm_still_callable"]


def test_torch_never_runs_triton():
    report = probe("torch", interpret=True)
    assert report["backend"] == "torch" and not report["available"]
    assert report["silu_ok"]
    assert report["fallback_warnings"] == 0


def test_triton_never_falls_back():
    report = probe("triton", interpret=False)
    assert not report["available"]
    assert "TRITON_INTERPRET" in report["error"]
    assert report["fallback_warnings"] == 0


@pytest.mark.parametrize("variable", ["NANOVLLM_KERNEL_BACKEND", "NANOVLLM_PAGED_DECODE"])
def test_unknown_choice_is_refused(variable):
    env = {**os.environ, variable: "cuda-please"}
    done = subprocess.run([sys.executable, "-c", "import nanovllm.kernels"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and variable in done.stderr


def test_cpu_is_never_graph_capturable():
    assert not kernels.graph_capturable("cpu")


def test_sampling_is_graph_capturable_with_the_triton_sampler_only(monkeypatch):
    """The model runner's sampling graphs: the reference's draws synchronise with the host, and
    the CUDA C++ sampler is not tested under capture."""
    monkeypatch.setattr(dispatch, "backend_for", lambda device: "triton")
    for sampler, capturable in (("triton", True), ("cuda", False), ("torch", False)):
        monkeypatch.setattr(dispatch, "SAMPLER", sampler)
        assert kernels.graph_capturable("cuda", sampling=True) == capturable
        assert kernels.graph_capturable("cuda")


@pytest.mark.gpu
def test_cuda_runs_triton_and_is_graph_capturable():
    if os.environ.get("NANOVLLM_KERNEL_BACKEND", "auto") == "torch":
        pytest.skip("NANOVLLM_KERNEL_BACKEND=torch in this process")
    assert kernels.KERNELS_AVAILABLE
    assert kernels.backend_for(torch.device("cuda")) == "triton"
    assert kernels.graph_capturable("cuda")
