"""What the kernel tests share: where they run, tolerances, float64 comparison, and inputs.

Every numerical test runs twice: on the CPU through Triton's interpreter (marker
`triton_interpret`, fp32 and bf16, the run of scripts/test.sh with TRITON_INTERPRET=1) and on
CUDA (marker `gpu`, every dtype). Both assert that Triton, not the PyTorch fallback, served."""
import pytest
import torch

from nanovllm import kernels
from nanovllm.utils.timing import capture

# ||out - ref|| / ||ref|| against float64: a few units of the output dtype's rounding. The
# interpreter rounds bf16 toward zero (the GPU to nearest), which doubles bf16's error there.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

TARGETS = [
    *(pytest.param("cpu", dtype, marks=pytest.mark.triton_interpret, id=f"interpreter-{str(dtype)[6:]}")
      for dtype in (torch.float32, torch.bfloat16)),
    *(pytest.param("cuda", dtype, marks=pytest.mark.gpu, id=f"cuda-{str(dtype)[6:]}")
      for dtype in (torch.bfloat16, torch.float16, torch.float32)),
]
# For the slower interpreter cases, whose dtype handling the full grid already covers.
FP32_INTERPRETER_AND_GPU = [TARGETS[0], *TARGETS[2:]]


def require_triton(device: str) -> None:
    """A silent fallback to the PyTorch reference would pass every comparison: fail instead."""
    assert kernels.backend_for(device) == "triton"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    error = relative_error(out, ref)
    assert error <= TOLERANCE[dtype], f"relative error {error:.3e} above {TOLERANCE[dtype]:.0e} for {dtype}"


def upcast(*tensors: torch.Tensor):
    return [t.double() for t in tensors]


def randn(*shape, dtype, device) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def strided_rows(rows: int, width: int, dtype, device) -> torch.Tensor:
    """[rows, width] whose rows lie further apart than `width`: a slice of a wider buffer."""
    return randn(rows, width + 48, dtype=dtype, device=device)[:, 16:16 + width]


def poison_allocator(nbytes: int, device: str) -> None:
    """Leaves NaN-filled freed memory for the next allocation to pick up (reliably with the
    CUDA caching allocator, often on the CPU), so output elements a kernel forgot to write
    show up as NaN instead of as plausible zeros."""
    torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=device)


def capture_and_replay(fn):
    """Captures fn() in a CUDA graph after a warm-up, replays it, and returns the output of
    the replay: fails if anything in fn synchronises with the host."""
    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    return out
