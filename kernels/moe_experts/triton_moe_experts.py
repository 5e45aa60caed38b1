"""Triton grouped GEMMs of the routed experts with the token gather and SiTU fused in.

Rows are the N·k token copies grouped by expert (``order``: row m is copy order[m], token
order[m] // k; expert e owns rows [row_start[e], row_start[e + 1])). A program owns a [BM, BN] output
tile of one expert. The one grid axis runs over (row tile, column tile) pairs, columns fastest, so that
the programs that share a row tile's A rows run side by side (L2 reuse); the row tiles are every expert's
(tile_start: exclusive cumsum of cdiv(rows_e, BM), found by binary search; programs past the last tile
exit).

* ``w13_situ_forward``: gu = z[token(m)] @ W13[e]ᵀ with the A rows read from z by index (no gathered
  copy of z) and, per output column j < I, the gate (column j) and up (column I + j) accumulators side
  by side; writes gu [M, 2I] (bf16, for the backward) and h = SiTU(gate, up) [M, I] computed from the
  stored (rounded) gu, as the separate SiTU kernel would.
* ``w2_dgrad_situ_backward``: dh = dy @ W2[e] [M, I] in fp32, then in the epilogue the SiTU backward
  against the saved gu: writes dgu [M, 2I] (dh itself never goes to memory).

Dots take bf16 operands (fp32 accumulate) on the GPU, or fp32 ones at full precision (not TF32); fp32 in
Triton's interpreter (DESIGN.md §7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..situ.triton_situ import situ_grad_math, situ_math

# The fastest of a CUDA-graph-timed sweep at bench-1B MoE dims (one H200, benchmarks/moe_components.py
# --fused-tiles): forward 0.344 ms (the bare torch._grouped_mm of its product: 0.165), backward 0.401 ms at
# 8 warps (bare: 0.091; 0.53-0.59 ms at 2-4 warps). Tiles with 128 rows ran the backward at 1.4-1.5 ms (its SiTU
# epilogue spills).
GPU_TILES_FWD = dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=3)
GPU_TILES_BWD = dict(BM=64, BN=64, BK=64, num_warps=8, num_stages=3)
INTERPRET_TILES = dict(BM=16, BN=16, BK=16)


@triton.jit
def _expert_tile(ROW_START, TILE_START, E, N_COL, I, SEARCH_STEPS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    """(expert, rows [BM], row mask, columns [BN] of I, column mask) of this program; expert = -1 past
    the last row tile."""
    pid = tl.program_id(0) // N_COL
    lo = 0
    hi = E
    for _ in tl.static_range(SEARCH_STEPS):  # TILE_START[lo] <= pid < TILE_START[hi]
        mid = (lo + hi) // 2
        right = tl.load(TILE_START + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    e = tl.where(pid < tl.load(TILE_START + E), lo, -1)
    rows = tl.load(ROW_START + lo) + (pid - tl.load(TILE_START + lo)) * BM + tl.arange(0, BM)
    cols = (tl.program_id(0) % N_COL) * BN + tl.arange(0, BN)
    return e, rows, rows < tl.load(ROW_START + lo + 1), cols, cols < I


@triton.jit
def _w13_situ_fwd_kernel(Z, ORDER, ROW_START, TILE_START, W13, GU, H, E, N_COL, L, I, TOP_K,
                         s_we, s_wn, s_wl, beta, linear_beta, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, rmask, cols, cmask = _expert_tile(ROW_START, TILE_START, E, N_COL, I, SEARCH_STEPS, BM, BN)
    if e < 0:
        return
    token = (tl.load(ORDER + rows, mask=rmask, other=0) // TOP_K).to(tl.int64)
    wg = W13 + e.to(tl.int64) * s_we + cols[None, :] * s_wn  # gate rows of W13[e], as [BK, BN] tiles
    wu = wg + I * s_wn  # up rows
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for l0 in range(0, L, BK):
        ls = l0 + tl.arange(0, BK)
        lmask = ls < L
        a = tl.load(Z + token[:, None] * L + ls[None, :], mask=rmask[:, None] & lmask[None, :], other=0.0)
        bmask = lmask[:, None] & cmask[None, :]
        bg = tl.load(wg + ls[:, None] * s_wl, mask=bmask, other=0.0)
        bu = tl.load(wu + ls[:, None] * s_wl, mask=bmask, other=0.0)
        if DOT_FP32:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    mask = rmask[:, None] & cmask[None, :]
    gate = acc_g.to(GU.dtype.element_ty)
    up = acc_u.to(GU.dtype.element_ty)
    gu_row = GU + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    tl.store(gu_row, gate, mask=mask)
    tl.store(gu_row + I, up, mask=mask)
    h = situ_math(gate.to(tl.float32), up.to(tl.float32), beta, linear_beta)
    tl.store(H + rows[:, None].to(tl.int64) * I + cols[None, :], h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _w2_dgrad_situ_bwd_kernel(DY, W2, GU, DGU, ROW_START, TILE_START, E, N_COL, L, I,
                              s_we, s_wl, s_wi, beta, linear_beta, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                              SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, rmask, cols, cmask = _expert_tile(ROW_START, TILE_START, E, N_COL, I, SEARCH_STEPS, BM, BN)
    if e < 0:
        return
    rows64 = rows.to(tl.int64)
    w = W2 + e.to(tl.int64) * s_we + cols[None, :] * s_wi  # W2[e] [ℓ, I] as [BK, BN] tiles
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for l0 in range(0, L, BK):
        ls = l0 + tl.arange(0, BK)
        lmask = ls < L
        a = tl.load(DY + rows64[:, None] * L + ls[None, :], mask=rmask[:, None] & lmask[None, :], other=0.0)
        b = tl.load(w + ls[:, None] * s_wl, mask=lmask[:, None] & cmask[None, :], other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    mask = rmask[:, None] & cmask[None, :]
    gu_row = GU + rows64[:, None] * (2 * I) + cols[None, :]
    gate = tl.load(gu_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + I, mask=mask, other=0.0).to(tl.float32)
    dgate, dup = situ_grad_math(gate, up, acc, beta, linear_beta)
    dgu_row = DGU + rows64[:, None] * (2 * I) + cols[None, :]
    tl.store(dgu_row, dgate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgu_row + I, dup.to(DGU.dtype.element_ty), mask=mask)


def interpreter_active() -> bool:
    return isinstance(_w13_situ_fwd_kernel, InterpretedFunction)


def _schedule(offsets: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_start [E+1], tile_start [E+1], binary-search steps) from the cumulative row counts ``offsets``
    [E], on the device (no host read)."""
    E = offsets.shape[0]
    row_start = torch.zeros(E + 1, dtype=torch.int64, device=offsets.device)
    row_start[1:] = offsets
    tiles = (row_start[1:] - row_start[:-1] + bm - 1) // bm
    tile_start = torch.zeros_like(row_start)
    tile_start[1:] = tiles.cumsum(0)
    return row_start, tile_start, max(1, (E - 1).bit_length())


def _tiles(t: torch.Tensor, gpu_tiles: dict) -> tuple[dict, dict]:
    """(block sizes, launch options with the dots' constexprs) for t's device and dtype: fp32 dots in
    the interpreter; on the GPU bf16 operands, or fp32 ones multiplied in full precision (not TF32)."""
    precision = "ieee" if t.dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit operands
    if t.is_cuda:
        tiles = dict(gpu_tiles)
        blocks = {k: tiles.pop(k) for k in ("BM", "BN", "BK")}
        return blocks, dict(tiles, DOT_FP32=False, PRECISION=precision)
    if interpreter_active():
        return dict(INTERPRET_TILES), dict(DOT_FP32=True, PRECISION="ieee")
    raise RuntimeError("the Triton MoE expert kernels got a CPU tensor, but Triton's interpreter is off: set "
                       "TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")


def _grid(rows: int, E: int, cols: int, blocks: dict) -> tuple[int, int]:
    """(programs, column tiles): every expert's partial last row tile at most adds one row tile."""
    n_col = triton.cdiv(cols, blocks["BN"])
    return (triton.cdiv(rows, blocks["BM"]) + E) * n_col, n_col


def w13_situ_forward(z: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, top_k: int,
                     beta: float, linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """z [N, ℓ], order [N·k], offsets [E] (cumulative rows), w13 [E, 2I, ℓ] → (gu [N·k, 2I], h [N·k, I]) in
    z's dtype."""
    M, (E, two_i, L) = order.shape[0], w13.shape
    I = two_i // 2
    gu = torch.empty(M, two_i, dtype=z.dtype, device=z.device)
    h = torch.empty(M, I, dtype=z.dtype, device=z.device)
    if M == 0:
        return gu, h
    blocks, opts = _tiles(z, GPU_TILES_FWD)
    row_start, tile_start, steps = _schedule(offsets, blocks["BM"])
    programs, n_col = _grid(M, E, I, blocks)
    _w13_situ_fwd_kernel[(programs,)](z, order, row_start, tile_start, w13, gu, h, E, n_col, L, I, top_k,
                                      *w13.stride(), float(beta), float(linear_beta),
                                      SEARCH_STEPS=steps, **blocks, **opts)
    return gu, h


def w2_dgrad_situ_backward(dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, offsets: torch.Tensor,
                           beta: float, linear_beta: float) -> torch.Tensor:
    """dy [N·k, ℓ] (contiguous), w2 [E, ℓ, I], gu [N·k, 2I] → dgu [N·k, 2I] in gu's dtype."""
    M, (E, L, I) = dy.shape[0], w2.shape
    dgu = torch.empty_like(gu)
    if M == 0:
        return dgu
    blocks, opts = _tiles(dy, GPU_TILES_BWD)
    row_start, tile_start, steps = _schedule(offsets, blocks["BM"])
    programs, n_col = _grid(M, E, I, blocks)
    _w2_dgrad_situ_bwd_kernel[(programs,)](dy, w2, gu, dgu, row_start, tile_start, E, n_col, L, I,
                                           *w2.stride(), float(beta), float(linear_beta),
                                           SEARCH_STEPS=steps, **blocks, **opts)
    return dgu
