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
def _wgrad_tile(G, X, DW, OFFSETS, ORDER, O, C, pid, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program ``pid``'s output tile: G, a descriptor of [M, O] with [BK, BM] blocks; X, of [M, C] with [BK, BN]
    blocks; DW [E, O, C]."""
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
def _grouped_wgrad_kernel(G, X, DW, OFFSETS, ORDER, O, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    _wgrad_tile(G, X, DW, OFFSETS, ORDER, O, C, tl.program_id(0), BM, BN, BK)


@triton.jit
def _grouped_wgrad_pair_kernel(G1, X1, DW1, O1, C1, G2, X2, DW2, O2, C2, OFFSETS, ORDER, FIRST,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Two weight gradients over the same groups: programs [0, FIRST) tile the first, the others the second."""
    pid = tl.program_id(0)
    if pid < FIRST:
        G, X, DW, O, C = G1, X1, DW1, O1, C1
    else:
        G, X, DW, O, C = G2, X2, DW2, O2, C2
        pid -= FIRST
    _wgrad_tile(G, X, DW, OFFSETS, ORDER, O, C, pid, BM, BN, BK)


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


def _product(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, tiles) -> tuple:
    """One weight gradient's kernel arguments (G's and X's descriptors, dW [E, O, C] uninitialised, O, C) and its
    programs."""
    BM, BN, BK = tiles[:3]
    (M, O), C, E = g.shape, x.shape[1], offsets.shape[0]
    if O * C >= 2**31:
        raise ValueError(f"an expert's weight [{O}, {C}] has 2^31 elements or more: the kernel's offsets are 32-bit")
    dw = torch.empty(E, O, C, dtype=g.dtype, device=g.device)
    args = (TensorDescriptor.from_tensor(g, [BK, BM]), TensorDescriptor.from_tensor(x, [BK, BN]), dw, O, C)
    return args, E * triton.cdiv(O, BM) * triton.cdiv(C, BN)


def _tiles(g: torch.Tensor, tiles):
    return tiles or (INTERPRETER_TILES if g.device.type == "cpu" else GPU_TILES)


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, tiles=None) -> torch.Tensor:
    """g [M, O], x [M, C] (rows grouped by expert; contiguous, rows 16-byte aligned), offsets [E]
    int32 cumulative → dW [E, O, C] in g.dtype. ``tiles``: (BM, BN, BK, warps, stages), else the defaults."""
    BM, BN, BK, warps, stages = tiles = _tiles(g, tiles)
    if g.shape[0] == 0:
        return torch.zeros(offsets.shape[0], g.shape[1], x.shape[1], dtype=g.dtype, device=g.device)
    (g_desc, x_desc, dw, O, C), programs = _product(g, x, offsets, tiles)
    _grouped_wgrad_kernel[(programs,)](g_desc, x_desc, dw, offsets, experts_by_size(offsets), O, C, BM=BM, BN=BN,
                                       BK=BK, num_warps=warps, num_stages=stages)
    return dw


def grouped_wgrad_pair(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, offsets: torch.Tensor,
                       tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``grouped_wgrad``(g1, x1), ``grouped_wgrad``(g2, x2)) over the same groups in one launch: one by-size
    order, and the second's programs fill the first's last wave."""
    BM, BN, BK, warps, stages = tiles = _tiles(g1, tiles)
    if g1.shape[0] == 0:
        return grouped_wgrad(g1, x1, offsets, tiles), grouped_wgrad(g2, x2, offsets, tiles)
    first, programs1 = _product(g1, x1, offsets, tiles)
    second, programs2 = _product(g2, x2, offsets, tiles)
    _grouped_wgrad_pair_kernel[(programs1 + programs2,)](*first, *second, offsets, experts_by_size(offsets),
                                                         programs1, BM=BM, BN=BN, BK=BK, num_warps=warps,
                                                         num_stages=stages)
    return first[2], second[2]
