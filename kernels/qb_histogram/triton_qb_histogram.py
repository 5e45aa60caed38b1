"""Triton histogram update of Quantile Balancing: one launch (math in ``reference.py``).

A program holds a [BLOCK_M, BLOCK_E ≥ E] tile of rows (all of a row's experts, E ≤ ``MAX_E``):
it loads the scores and the rows' cutoffs, computes each (token, expert) bin in fp32 with an
IEEE division (``div_rn``, as torch divides, so the bins are the reference's bit for bit), and
adds one to counts[e, bin] with an integer atomic. Integer adds commute, so the counts do not
depend on the order the programs run in. NaN scores land in bin 0, as in the reference.

On CPU the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported), on small tiles so that tests cover several programs and the row edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..row_tiles import row_tiles

MAX_E = 4096
GPU_BLOCK_ELEMS = 4096  # elements of one [BLOCK_M, BLOCK_E] tile (untuned)


@triton.jit
def _histogram_kernel(S, CUTOFF, LO, WIDTH, COUNTS, M, E, B, stride_sm,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < E)
    s = tl.load(S + rows[:, None].to(tl.int64) * stride_sm + cols[None, :], mask=mask, other=0.0)
    alpha = tl.load(CUTOFF + rows, mask=row_ok, other=0.0)
    lo = tl.load(LO)
    width = tl.load(WIDTH)
    x = tl.floor(tl.math.div_rn((alpha[:, None] - s) - lo, width))
    x = tl.where(x > 0.0, x, 0.0)  # also NaN → 0
    b = tl.minimum(x, B - 1.0).to(tl.int64)  # B - 1.0: B may come in as the constexpr 1
    tl.atomic_add(COUNTS + cols[None, :].to(tl.int64) * B + b, 1, mask=mask, sem="relaxed")  # order is moot


def _interpreted() -> bool:
    return isinstance(_histogram_kernel, InterpretedFunction)


def histogram_add(counts: torch.Tensor, scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor,
                  width: torch.Tensor) -> None:
    """counts [E, B] int32 contiguous (added into), scores [N, E] fp32 (rows of any stride, last dim
    contiguous), cutoff [N] fp32 contiguous, lo and width 0-d fp32."""
    M, E = scores.shape
    block_m, block_e, warps = row_tiles(E, MAX_E, GPU_BLOCK_ELEMS, _interpreted(),
                                        "the Triton QB histogram's expert count")
    if M == 0:
        return
    _histogram_kernel[(triton.cdiv(M, block_m),)](scores, cutoff, lo, width, counts, M, E, counts.shape[1],
                                                 scores.stride(0), BLOCK_M=block_m, BLOCK_E=block_e,
                                                 num_warps=warps)
