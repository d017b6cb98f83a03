"""The one launch rule the Triton kernels share: how many rows a program takes and how many
warps it runs with. A cheap function of the shape, so a first call costs only compilation:
no autotuning at request time."""

# Elements one program moves per operand: several short rows (q/k norm, D=128) or one 4K row,
# 16 values a thread at 8 warps, enough bytes in flight to keep HBM busy.
TILE_ELEMENTS = 4096
# About two programs an SM on a 132-SM H100/H200: below that, a decode-sized batch leaves SMs
# idle, so rows are spread one a program before tiles grow.
MIN_PROGRAMS = 256


# triton.cdiv and triton.next_power_of_2 are constexpr_functions in Triton 3.6: called from
# host code they cost microseconds each (argument unwrapping), several times a launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def rows_per_program(n_rows: int, row_elements: int, programs_per_row: int = 1,
                     tile_elements: int = TILE_ELEMENTS) -> int:
    """A power of two: rows enough to fill `tile_elements`, fewer while the grid would drop
    under MIN_PROGRAMS, and never more than the rows there are."""
    spread = max(1, n_rows * programs_per_row // MIN_PROGRAMS)
    fill = max(1, tile_elements // row_elements)
    return min(fill, 1 << (spread.bit_length() - 1), next_power_of_2(n_rows))


def num_warps(tile_elements: int, programs: int, per_thread: int = 16, most: int = 16) -> int:
    """`per_thread` values a thread (16: two 16-byte vectors of bf16), 1 to 16 warps; 8 (one
    vector) for grids of fewer than four programs an SM (decode sizes), where a call lasts
    about as long as one program's chain of loads and more threads shorten it (sweeps in
    docs/rejected.md). At most `most` warps."""
    per_thread = 8 if programs < 2 * MIN_PROGRAMS else per_thread
    return min(most, max(1, tile_elements // (32 * per_thread)))
