"""Triton kernel of the grouped weight gradient dW[e] = G_eᵀ X_e (math in ``reference.py``).

One program per (expert, output tile): it walks its expert's rows BK at a time, both operands
through host-side tensor descriptors (TMA on Hopper), and accumulates in fp32. The expert's last,
partial row block is read once more with the rows past its end zeroed (the descriptor's box would
otherwise read the next expert's rows). Programs are ordered by their expert's row count, largest
first, so the longest ones start first and the short ones fill the tail; one small launch finds that order
(``_by_size_kernel``: a comparison of every pair of experts' counts, where torch's diff, stable argsort and casts
took ~8 launches a call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# (BM, BN, BK, warps, stages) on the GPU: the fastest of seven tiles at bench-1B's W13 and W2 on one H200
# (docs/results/grouped_wgrad_tiles_h200_2026-12-02.json; 128×128 was 3-6% slower). Those runs stored dW
# through 64-bit pointer tiles, which took 255 registers and a 408-byte stack at 128×256 (Triton 3.6, sm_90);
# with 32-bit offsets within an expert's block it takes 202 and no stack (128×128: 93), not yet timed.
# The interpreter takes small tiles.
GPU_TILES = (128, 256, 64, 8, 3)
INTERPRETER_TILES = (16, 16, 16, 4, 1)
BY_SIZE_BLOCK = 128  # experts per program of the by-size order (bench-1B's 128: one program)
INTERPRETER_BY_SIZE_BLOCK = 16  # several programs and column blocks in the CPU tests


@triton.jit
def _grouped_wgrad_kernel(G, X, DW, OFFSETS, ORDER, O, C, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    """G: descriptor of [M, O] with [BK, BM] blocks; X: of [M, C] with [BK, BN] blocks; DW [E, O, C]."""
    pid = tl.program_id(0)
    tiles_c = tl.cdiv(C, BN)
    per_expert = tl.cdiv(O, BM) * tiles_c
    e = tl.load(ORDER + pid // per_expert)
    tile = pid % per_expert
    o0 = (tile // tiles_c) * BM
    c0 = (tile % tiles_c) * BN
    start = tl.load(OFFSETS + e - 1, mask=e > 0, other=0)
    end = tl.load(OFFSETS + e)
    full = (end - start) // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(full):
        r = start + i * BK
        acc = tl.dot(G.load([r, o0]).T, X.load([r, c0]), acc)
    r = start + full * BK
    if r < end:
        rows = r + tl.arange(0, BK)
        x = tl.where((rows < end)[:, None], X.load([r, c0]), 0.0)
        acc = tl.dot(G.load([r, o0]).T, x, acc)
    o = o0 + tl.arange(0, BM)
    c = c0 + tl.arange(0, BN)
    base = DW + e.to(tl.int64) * O * C  # the expert's [O, C] block; offsets within it fit 32 bits
    tl.store(base + (o[:, None] * C + c[None, :]), acc.to(DW.dtype.element_ty), mask=(o[:, None] < O) & (c[None, :] < C))


@triton.jit
def _expert_rows(OFFSETS, e, E):
    """n_e = the rows of expert e from the cumulative OFFSETS [E]; −1 for e ≥ E (sorts after every expert)."""
    ends = tl.load(OFFSETS + e, mask=e < E, other=0)
    return tl.where(e < E, ends - tl.load(OFFSETS + e - 1, mask=(e > 0) & (e < E), other=0), -1)


@triton.jit
def _by_size_kernel(OFFSETS, ORDER, E, BLOCK: tl.constexpr):
    """order = the experts by row count, largest first, ties by id (a stable descending argsort): expert e goes
    to #{f : n_f > n_e, or n_f = n_e and f < e}. One program per BLOCK experts e, walking every f BLOCK at a time
    (a [BLOCK, BLOCK] comparison tile, whatever E)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_e = _expert_rows(OFFSETS, e, E)[:, None]
    ahead = tl.zeros((BLOCK,), dtype=tl.int32)
    for f0 in range(0, E, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        n_f = _expert_rows(OFFSETS, f, E)[None, :]
        ahead += tl.sum(((n_f > n_e) | ((n_f == n_e) & (f[None, :] < e[:, None]))).to(tl.int32), axis=1)
    tl.store(ORDER + ahead, e, mask=e < E)


def experts_by_size(offsets: torch.Tensor) -> torch.Tensor:
    """offsets [E] int32 cumulative → [E] int32: the experts by row count, largest first, ties by id."""
    order = torch.empty_like(offsets)
    E = offsets.shape[0]
    block = BY_SIZE_BLOCK if offsets.is_cuda else INTERPRETER_BY_SIZE_BLOCK
    _by_size_kernel[(triton.cdiv(E, block),)](offsets, order, E, BLOCK=block)
    return order


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, tiles=None) -> torch.Tensor:
    """g [M, O], x [M, C] (rows grouped by expert; contiguous, rows 16-byte aligned), offsets [E]
    int32 cumulative → dW [E, O, C] in g.dtype. ``tiles``: (BM, BN, BK, warps, stages), else the defaults."""
    BM, BN, BK, warps, stages = tiles or (INTERPRETER_TILES if g.device.type == "cpu" else GPU_TILES)
    M, O = g.shape
    C = x.shape[1]
    E = offsets.shape[0]
    if M == 0:
        return torch.zeros(E, O, C, dtype=g.dtype, device=g.device)
    if O * C >= 2**31:
        raise ValueError(f"an expert's weight [{O}, {C}] has 2^31 elements or more: the kernel's offsets are 32-bit")
    dw = torch.empty(E, O, C, dtype=g.dtype, device=g.device)
    order = experts_by_size(offsets)
    g_desc = TensorDescriptor.from_tensor(g, [BK, BM])
    x_desc = TensorDescriptor.from_tensor(x, [BK, BN])
    grid = (E * triton.cdiv(O, BM) * triton.cdiv(C, BN),)
    _grouped_wgrad_kernel[grid](g_desc, x_desc, dw, offsets, order, O, C, BM=BM, BN=BN, BK=BK,
                                num_warps=warps, num_stages=stages)
    return dw
