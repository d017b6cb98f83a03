"""The shared launch rule (nanovllm/kernels/tiling.py): a pure function of the shape."""
import torch

from nanovllm.kernels import tiling


def test_rows_fill_the_tile_unless_the_grid_would_leave_sms_idle():
    assert tiling.rows_per_program(4096, 1024) == 4
    assert tiling.rows_per_program(4096, 1024, tile_elements=2048) == 2
    assert tiling.rows_per_program(256, 1024) == 1  # 256 programs: one row each
    assert tiling.rows_per_program(100_000, 128) == 32  # short rows: 4096 elements a program
    assert tiling.rows_per_program(3, 128) == 1


def test_warps_carry_the_asked_values_a_thread_on_full_grids_and_one_vector_on_small_ones():
    assert tiling.num_warps(4096, 1024) == 8  # 16 values a thread
    assert tiling.num_warps(4096, 1024, per_thread=64) == 2
    assert tiling.num_warps(4096, 256, per_thread=64) == 16  # decode-sized grid: 8 a thread
    assert tiling.num_warps(64, 1024) == 1 and tiling.num_warps(1 << 20, 1024) == 16


def _record_launches(monkeypatch, module, kernel_name: str, tile_constexpr: str) -> list:
    """Replaces module.kernel_name by a stand-in that records (grid, the tile constexpr, warps)
    of every launch, instead of running anything."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, num_warps, **constexprs: launches.append((grid, constexprs[tile_constexpr], num_warps))
    monkeypatch.setattr(module, kernel_name, Recorder())
    return launches


def test_a_residual_norm_takes_two_1024_wide_rows_on_one_warp_and_a_4096_wide_row_on_two(monkeypatch):
    from nanovllm.kernels import norm
    launches = _record_launches(monkeypatch, norm, "_rms_norm_kernel", "BLOCK_R")
    for width in (1024, 4096):
        x = torch.randn(4096, width)
        norm.fused_add_rms_norm(x, torch.randn_like(x), torch.randn(width), 1e-6)
    assert launches == [((2048,), 2, 1), ((4096,), 1, 2)]


def test_warps_stop_at_the_cap():
    assert tiling.num_warps(8192, 3072) == 16 and tiling.num_warps(8192, 3072, 16, 8) == 8


def test_the_q_k_prologue_splits_q_into_k_sized_parts_of_two_qwen3_tokens_on_4_warps(monkeypatch):
    from nanovllm.kernels import qk_norm_rope
    launches = _record_launches(monkeypatch, qk_norm_rope, "_qk_norm_rope_store_kernel", "BLOCK_T")
    for tokens in (1, 4096):  # Qwen3-0.6B: 16 q heads, 8 kv heads of 128: two q parts, k, v
        q, k, v = torch.randn(tokens, 32, 128).split([16, 8, 8], dim=1)
        qk_norm_rope.qk_norm_rope_store(q, k, v, torch.zeros(tokens, dtype=torch.long), torch.randn(8, 128),
                                        torch.empty(4, 16, 8, 128), torch.empty(4, 16, 8, 128),
                                        torch.zeros(tokens, dtype=torch.long))
    assert launches == [((4,), 1, 4), ((8192,), 2, 4)]
