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

Operands that are whole tiles of a 2-D tensor come through host-side tensor descriptors (TMA on Hopper:
copied to shared memory by the copy engine, no per-element pointers in registers): W13 as [E·2I, ℓ], W2
as [E·ℓ, I] and, in the backward, dy's expert-sorted rows as [M, ℓ]. A dy tile may run into the next
expert's rows (or past M, zero-filled); those rows are computed and not stored. Only the gathered z rows
are loaded through pointers. So ℓ must be a multiple of BK and I of BN (every tile stays in one expert).

Dots take bf16 operands (fp32 accumulate) on the GPU, or fp32 ones at full precision (not TF32); fp32 in
Triton's interpreter (DESIGN.md §7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from ..situ.triton_situ import situ_grad_math, situ_math

# Chosen from offline sm_90 compiles (Triton 3.9, cuobjdump), not yet timed: the widest tiles without spills,
# forward 64×128×64 at 8 warps (194 registers; 256 columns spill: two [64, 256] fp32 accumulators), backward
# 64×256×64 at 8 warps (198 registers: one column tile covers I = 256, so each dy row tile is read once).
# Before the descriptors and the quarter-tile epilogues the sweep's best were 64×64×64 at 4 and 8 warps
# (forward 0.344 ms, backward 0.401 ms at bench-1B MoE dims against 0.165 and 0.091 for the bare
# torch._grouped_mm; 196-255 registers, spills at every wider tile; docs/moe_notes.md §2).
GPU_TILES_FWD = dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=3)
GPU_TILES_BWD = dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=3)
INTERPRET_TILES = dict(BM=16, BN=16, BK=16)


@triton.jit
def _expert_tile(ROW_START, TILE_START, E, N_COL, SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(expert, rows [BM], row mask, first column) of this program; expert = -1 past the last row tile."""
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
    return e, rows, rows < tl.load(ROW_START + lo + 1), (tl.program_id(0) % N_COL) * BN


@triton.jit
def _w13_situ_fwd_kernel(Z, ORDER, ROW_START, TILE_START, W13, GU, H, E, N_COL, L, I, TOP_K,
                         beta, linear_beta, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W13: descriptor of [E·2I, ℓ] with [BN, BK] blocks."""
    e, rows, rmask, col0 = _expert_tile(ROW_START, TILE_START, E, N_COL, SEARCH_STEPS, BM, BN)
    if e < 0:
        return
    token = (tl.load(ORDER + rows, mask=rmask, other=0) // TOP_K).to(tl.int64)
    gate_row = (e * 2 * I + col0).to(tl.int32)  # W13 row of the first gate column
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for l0 in range(0, L, BK):
        ls = l0 + tl.arange(0, BK)
        a = tl.load(Z + token[:, None] * L + ls[None, :], mask=rmask[:, None], other=0.0)
        bg = tl.trans(W13.load([gate_row, l0]))
        bu = tl.trans(W13.load([gate_row + I, l0]))
        if DOT_FP32:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    rows64 = rows.to(tl.int64)
    q = tl.arange(0, BN // 4)
    g01, g23 = _halves(acc_g, BM, BN)
    u01, u23 = _halves(acc_u, BM, BN)
    g0, g1 = _halves(g01, BM, BN // 2)
    u0, u1 = _halves(u01, BM, BN // 2)
    _situ_fwd_epilogue(g0, u0, GU, H, rows64, rmask, col0 + q, I, beta, linear_beta)
    _situ_fwd_epilogue(g1, u1, GU, H, rows64, rmask, col0 + BN // 4 + q, I, beta, linear_beta)
    g2, g3 = _halves(g23, BM, BN // 2)
    u2, u3 = _halves(u23, BM, BN // 2)
    _situ_fwd_epilogue(g2, u2, GU, H, rows64, rmask, col0 + BN // 2 + q, I, beta, linear_beta)
    _situ_fwd_epilogue(g3, u3, GU, H, rows64, rmask, col0 + 3 * BN // 4 + q, I, beta, linear_beta)


@triton.jit
def _halves(x, BM: tl.constexpr, W: tl.constexpr):
    """An [BM, W] tile's columns [0, W/2) and [W/2, W), as two [BM, W/2] tiles."""
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, W // 2)), (0, 2, 1)))


@triton.jit
def _situ_fwd_epilogue(acc_g, acc_u, GU, H, rows64, rmask, cols, I, beta, linear_beta):
    """Stores gu's gate and up columns ``cols`` (rounded to GU's dtype) and h = SiTU of the stored values.
    The epilogues run on quarter tiles so that SiTU's temporaries live for a quarter of the tile at a time."""
    gate = acc_g.to(GU.dtype.element_ty)
    up = acc_u.to(GU.dtype.element_ty)
    gu_row = GU + rows64[:, None] * (2 * I) + cols[None, :]
    tl.store(gu_row, gate, mask=rmask[:, None])
    tl.store(gu_row + I, up, mask=rmask[:, None])
    h = situ_math(gate.to(tl.float32), up.to(tl.float32), beta, linear_beta)
    tl.store(H + rows64[:, None] * I + cols[None, :], h.to(H.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _w2_dgrad_situ_bwd_kernel(DY, W2, GU, DGU, ROW_START, TILE_START, E, N_COL, L, I,
                              beta, linear_beta, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                              SEARCH_STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """DY: descriptor of [M, ℓ] with [BM, BK] blocks; W2: of [E·ℓ, I] with [BK, BN] blocks; GU: of [M, 2I] with
    [BM, BN] blocks."""
    e, rows, rmask, col0 = _expert_tile(ROW_START, TILE_START, E, N_COL, SEARCH_STEPS, BM, BN)
    if e < 0:
        return
    rows64 = rows.to(tl.int64)
    row0 = tl.min(rows, axis=0).to(tl.int32)  # descriptor offsets are 32-bit
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for l0 in range(0, L, BK):
        a = DY.load([row0, l0])
        b = W2.load([(e * L + l0).to(tl.int32), col0])
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    q = tl.arange(0, BN // 4)
    d01, d23 = _halves(acc, BM, BN)
    d0, d1 = _halves(d01, BM, BN // 2)
    _situ_bwd_epilogue(d0, GU, DGU, rows64, rmask, row0, col0, q, I, beta, linear_beta)
    _situ_bwd_epilogue(d1, GU, DGU, rows64, rmask, row0, col0 + BN // 4, q, I, beta, linear_beta)
    d2, d3 = _halves(d23, BM, BN // 2)
    _situ_bwd_epilogue(d2, GU, DGU, rows64, rmask, row0, col0 + BN // 2, q, I, beta, linear_beta)
    _situ_bwd_epilogue(d3, GU, DGU, rows64, rmask, row0, col0 + 3 * BN // 4, q, I, beta, linear_beta)


@triton.jit
def _situ_bwd_epilogue(dh, GU, DGU, rows64, rmask, row0, col0, q, I, beta, linear_beta):
    """dgu of the tile's columns col0 + q from dh (fp32) and the saved gate and up (GU: descriptor with
    [BM, BN/4] blocks): a quarter tile at a time, as the forward's epilogue."""
    gate = GU.load([row0, col0]).to(tl.float32)
    up = GU.load([row0, col0 + I]).to(tl.float32)
    dgate, dup = situ_grad_math(gate, up, dh, beta, linear_beta)
    dgu_row = DGU + rows64[:, None] * (2 * I) + (col0 + q)[None, :]
    tl.store(dgu_row, dgate.to(DGU.dtype.element_ty), mask=rmask[:, None])
    tl.store(dgu_row + I, dup.to(DGU.dtype.element_ty), mask=rmask[:, None])


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


def _fit(blocks: dict, L: int, I: int) -> dict:
    """``blocks`` with BK and BN no wider than ℓ and I (rounded up to powers of two), for small test shapes;
    checks that the descriptors' tiles do not cross from one expert's weights into the next's."""
    blocks = dict(blocks, BK=min(blocks["BK"], triton.next_power_of_2(L)), BN=min(blocks["BN"], triton.next_power_of_2(I)))
    if L % blocks["BK"] or I % blocks["BN"]:
        raise ValueError(f"the fused expert kernels need ℓ = {L} a multiple of BK = {blocks['BK']} and I = {I} a "
                         f"multiple of BN = {blocks['BN']} (set the tiles in kernels/moe_experts/triton_moe_experts.py)")
    return blocks


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
    blocks = _fit(blocks, L, I)
    row_start, tile_start, steps = _schedule(offsets, blocks["BM"])
    programs, n_col = _grid(M, E, I, blocks)
    w13_desc = TensorDescriptor.from_tensor(w13.contiguous().view(E * two_i, L), [blocks["BN"], blocks["BK"]])
    _w13_situ_fwd_kernel[(programs,)](z, order, row_start, tile_start, w13_desc, gu, h, E, n_col, L, I, top_k,
                                      float(beta), float(linear_beta), SEARCH_STEPS=steps, **blocks, **opts)
    return gu, h


def w2_dgrad_situ_backward(dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, offsets: torch.Tensor,
                           beta: float, linear_beta: float) -> torch.Tensor:
    """dy [N·k, ℓ] (contiguous), w2 [E, ℓ, I], gu [N·k, 2I] → dgu [N·k, 2I] in gu's dtype."""
    M, (E, L, I) = dy.shape[0], w2.shape
    dgu = torch.empty_like(gu)
    if M == 0:
        return dgu
    blocks, opts = _tiles(dy, GPU_TILES_BWD)
    blocks = _fit(blocks, L, I)
    row_start, tile_start, steps = _schedule(offsets, blocks["BM"])
    programs, n_col = _grid(M, E, I, blocks)
    dy_desc = TensorDescriptor.from_tensor(dy, [blocks["BM"], blocks["BK"]])
    gu_desc = TensorDescriptor.from_tensor(gu, [blocks["BM"], blocks["BN"] // 4])
    w2_desc = TensorDescriptor.from_tensor(w2.contiguous().view(E * L, I), [blocks["BK"], blocks["BN"]])
    _w2_dgrad_situ_bwd_kernel[(programs,)](dy_desc, w2_desc, gu_desc, dgu, row_start, tile_start, E, n_col, L, I,
                                           float(beta), float(linear_beta), SEARCH_STEPS=steps, **blocks, **opts)
    return dgu
