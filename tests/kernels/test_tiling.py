"""The shared launch rule (nanovllm/kernels/_tiling.py): a pure function of the shape."""
from nanovllm.kernels import _tiling


def test_rows_fill_the_tile_unless_the_grid_would_leave_sms_idle():
    assert _tiling.rows_per_program(4096, 1024) == 4
    assert _tiling.rows_per_program(4096, 1024, tile_elements=2048) == 2
    assert _tiling.rows_per_program(256, 1024) == 1  # 256 programs: one row each
    assert _tiling.rows_per_program(100_000, 128) == 32  # short rows: 4096 elements a program
    assert _tiling.rows_per_program(3, 128) == 1


def test_warps_carry_the_asked_values_a_thread_on_full_grids_and_one_vector_on_small_ones():
    assert _tiling.num_warps(4096, 1024) == 8  # 16 values a thread
    assert _tiling.num_warps(4096, 1024, per_thread=64) == 2
    assert _tiling.num_warps(4096, 256, per_thread=64) == 16  # decode-sized grid: 8 a thread
    assert _tiling.num_warps(64, 1024) == 1 and _tiling.num_warps(1 << 20, 1024) == 16
