"""The float64 correctness grid that test_custom_kernels.py runs first (benchmarks/kernel_cases.py),
bounded to CPU sizes: every op, contiguous and strided inputs, odd widths. Tolerances per dtype
are kernel_cases.TOLERANCE (fp32 1e-5, fp16 2e-3, bf16 1e-2; the KV-cache store exactly)."""
import pytest
import torch
from kernel_testing import require_triton

from benchmarks.kernel_cases import OPS, run_correctness

CPU = torch.device("cpu")
OP_NAMES = [op.name for op in OPS]


def _grid_errors(op_name: str, grid: tuple, backends: dict):
    records, mismatches = run_correctness(CPU, grid, backends, ops=[op for op in OPS if op.name == op_name])
    assert records and {r["backend"] for r in records} == set(backends)
    return [r for r in records if not r["ok"]], mismatches


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_references_and_public_functions_match_float64(op_name):
    """The references in each dtype, and the public functions with their argument checks
    (served by the references here), against the references in float64."""
    grid = ((1, 7, 64), (200, 1024, 4095), (torch.float32, torch.float16, torch.bfloat16))
    failed, mismatches = _grid_errors(op_name, grid, {"reference": lambda op: op.ref, "public": lambda op: op.fused})
    assert mismatches == 0, failed


@pytest.mark.triton_interpret
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_triton_kernels_match_float64_in_the_interpreter(op_name):
    require_triton("cpu")
    failed, mismatches = _grid_errors(op_name, ((1, 7), (200, 1024), (torch.float32, torch.bfloat16)),
                                      {"triton": lambda op: op.fused})
    assert mismatches == 0, failed
