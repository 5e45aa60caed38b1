"""Launch shape shared by the kernels whose program holds whole rows: a [BLOCK_M, BLOCK_N ≥ n] tile
(RMSNorm, the router tail, the QB histogram)."""

from __future__ import annotations

from typing import NamedTuple

import triton

INTERPRET_BLOCK_M = 4  # small tiles in Triton's interpreter, so tests cover several blocks and the row edge


class RowTiles(NamedTuple):
    block_m: int  # rows a program
    block_n: int  # next power of two ≥ the row length
    num_warps: int


def row_tiles(n: int, max_n: int, gpu_block_elems: int, interpreted: bool, what: str) -> RowTiles:
    """Tiles of about ``gpu_block_elems`` elements for rows of ``n`` ≤ ``max_n`` (``what`` names the
    row in the error); ``INTERPRET_BLOCK_M`` rows a program in the interpreter."""
    if n > max_n:
        raise ValueError(f"{what}: at most {max_n}, got {n}")
    block_n = triton.next_power_of_2(n)
    block_m = INTERPRET_BLOCK_M if interpreted else max(1, gpu_block_elems // block_n)
    return RowTiles(block_m, block_n, 8 if block_m * block_n >= 8192 else 4)
