"""Triton Block AttnRes aggregation: one forward kernel and one backward kernel, each optionally
ending in the site's RMSNorm (``NORM``), in two families: the row kernels, for rows that fit one tile
(d ≤ GPU_ROWS_MAX_D: bench models), and the chunked kernels for wider rows.

Row kernels (``_attn_res_{fwd,bwd}_rows_kernel``): a program holds its tokens' whole rows of every
source in registers (eight tile values, slots past S unused), so every tensor is read from memory
once a kernel and nothing is read twice; the backward walks token blocks as below and keeps its dq̃
(and dw_n) in registers. The math is the one described next, with x = Σ a_i v_i formed in registers.

Chunked kernels:

The S ≤ MAX_SOURCES sources are separate [M, d] tensors (row-major, M tokens) passed as separate
pointer arguments V0..V7 with a constexpr S (unused slots repeat V0 and are never read); nothing
is stacked. A block of BLOCK_M tokens walks d in chunks of BLOCK_D more than once; every pass after
the first re-reads rows this program has just read, so mostly from cache.

* forward, pass 1: reads every source once and accumulates Σ v_i² and q̃ · v_i per token, giving
  r_i, l_i = r_i q̃ · v_i and a = softmax(l) ([BLOCK_M, S_PAD] tiles, S_PAD = next power of two);
  saved for the backward: r and a as [M, S] fp32 (8·S bytes a token). Then x = Σ a_i v_i:
  written as the output; with ``NORM``, one pass sums x² for n = (mean(x²) + ε_n)^(-1/2) and a
  last one writes y = x·n ⊙ w_n instead (x itself is never stored).
* backward: pass 1 reads g = ∂L/∂x and every v_i once for c_i = g · v_i and p_i = q̃ · v_i, forming
  dl_i = a_i (c_i − Σ_j a_j c_j); pass 2 re-reads them and writes
  dv_i = a_i g + dl_i r_i q̃ − dl_i (r_i³/d) p_i v_i (plus, for the sources flagged in ``GRAD_IN``, the
  gradient they already have, read from GI_i) and adds Σ_i dl_i r_i v_i to dq̃. With ``NORM``
  the kernel reads dy = ∂L/∂y instead of g and rebuilds x from the sources in both passes:
  g = n (w_n ⊙ dy) − n³ (x · (w_n ⊙ dy)/d) x, so c_i = n (w_n ⊙ dy) · v_i − n³ (x · (w_n ⊙ dy)/d) (x · v_i),
  and dw_n gets Σ_tokens dy ⊙ x n.
  A fixed number P of programs (a few per SM) each walk every P-th token block and add their part
  of dq̃ (and dw_n) into their own row of a [P, d] fp32 buffer, summed by the caller:
  deterministic, no atomics, and a buffer that stays in L2.

Loads are cast to fp32, all math is fp32, stores cast to the output's dtype. On CPU the kernels
run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .reference import RMS_EPS

MAX_SOURCES = 8
# GPU tiles: BLOCK_M tokens a program (and its warps), BLOCK_D ≤ GPU_MAX_BLOCK_D features a chunk. Swept with
# benchmarks/attn_res.py --tiles at 32768 tokens, d = 1024, fp32 sources on one H200
# (docs/results/attn_res_tiles_h200_2026-12-01.json): 2 tokens × 4 warps is the fastest forward at every S
# from 1 to 5; the backward prefers 8 × 4 up to 3 sources, 2 × 4 from 4 on. ``GPU_TILE_OVERRIDE`` (set
# by the benchmark's sweep) replaces both. The backward runs GPU_BWD_PROGRAMS_PER_SM programs an SM
# (``GPU_BWD_PROGRAMS_OVERRIDE`` for the sweep). The interpreter takes small tiles and few backward
# programs so tests cover several row blocks a program, several d chunks and the masked edges.
GPU_FWD_TILE = (2, 4)
GPU_BWD_TILE_FEW, GPU_BWD_TILE_MANY, GPU_BWD_FEW_SOURCES = (8, 4), (2, 4), 3
GPU_MAX_BLOCK_D = 512
# Rows of up to GPU_ROWS_MAX_D features (padded to a power of two) take the row kernels instead: a program
# holds its tokens' whole rows of every source in registers, so each is read from memory once a kernel.
GPU_ROWS_MAX_D = 2048
# (BLOCK_M, num_warps) at d ≤ 1024. Session 14 (no passed sources): 1 token × 4 warps fastest or within 6%
# both ways at 2, 5 and 8 sources (docs/results/attn_res_norm_rows_tiles_h200_2026-12-01.json). Session 16, the
# site as the model runs it (its norm, every source passed on with a gradient to add; 32768 tokens, one H200;
# benchmarks/attn_res.py --norm --passed --tiles, docs/results/attn_res_passed_tiles_h200_2026-12-01.json),
# fwd+bwd ms 1x4 / 2x4 / 1x8 / 2x8: 2 sources 0.400 / 0.375 / 0.465 / 0.738, 5 sources 1.106 / 0.888 / 1.121 /
# 1.667; forward alone 2x4 is 4-13% faster than 1x4. Two tokens hold twice the registers, and one token
# took up to 255 at 8 sources (session 14's offline compiles), so more than 5 sources keep one token.
GPU_ROWS_TILE, GPU_ROWS_TILE_MANY, GPU_ROWS_FEW_SOURCES = (2, 4), (1, 4), 5
INTERPRET_ROWS_MAX_D = 128
GPU_BWD_PROGRAMS_PER_SM = 8
GPU_TILE_OVERRIDE: tuple[int, ...] | None = None  # (BLOCK_M, num_warps[, BLOCK_D])
GPU_BWD_PROGRAMS_OVERRIDE: int | None = None
INTERPRET_BLOCKS = (4, 64)
INTERPRET_BWD_PROGRAMS = 2


def gpu_tile(S: int, D: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, BLOCK_D) of the forward or backward kernel for S sources of d = D on a GPU."""
    block_d = min(GPU_MAX_BLOCK_D, max(16, triton.next_power_of_2(D)))
    if GPU_TILE_OVERRIDE is not None:
        return (*GPU_TILE_OVERRIDE, block_d)[:3]
    if not backward:
        return (*GPU_FWD_TILE, block_d)
    return (*(GPU_BWD_TILE_FEW if S <= GPU_BWD_FEW_SOURCES else GPU_BWD_TILE_MANY), block_d)


@triton.jit
def _pick(i: tl.constexpr, P0, P1, P2, P3, P4, P5, P6, P7):
    """Pointer argument number ``i`` (resolved at compile time)."""
    p = P0
    if i == 1:
        p = P1
    if i == 2:
        p = P2
    if i == 3:
        p = P3
    if i == 4:
        p = P4
    if i == 5:
        p = P5
    if i == 6:
        p = P6
    if i == 7:
        p = P7
    return p


@triton.jit
def _column(x, scol, i: tl.constexpr):
    """x[:, i] of an [BLOCK_M, S_PAD] tile, as [BLOCK_M]."""
    return tl.sum(tl.where(scol == i, x, 0.0), axis=1)


@triton.jit
def _load(V, offs, mask):
    return tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mix(a, scol, V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S: tl.constexpr):
    """x = Σ_i a_i v_i over one [BLOCK_M, BLOCK_D] chunk at ``offs``, fp32."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _load_sources(V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S)
    return _mix_held(a, scol, v0, v1, v2, v3, v4, v5, v6, v7, S)


@triton.jit
def _attn_res_fwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, Q, NW, O, R, A, M, D, eps, norm_eps,
                         S: tl.constexpr, S_PAD: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows2, ok2 = rows[:, None], row_ok[:, None]
    scol = tl.arange(0, S_PAD)[None, :]
    sumsq = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)
    qdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = ok2 & (cols[None, :] < D)
        q = tl.load(Q + cols, mask=cols < D, other=0.0)[None, :]
        for i in tl.static_range(S):
            v = _load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7), rows2 * D + cols[None, :], mask)
            sumsq += tl.where(scol == i, tl.sum(v * v, axis=1)[:, None], 0.0)
            qdot += tl.where(scol == i, tl.sum(v * q, axis=1)[:, None], 0.0)
    r = 1.0 / tl.sqrt(sumsq / D + eps)
    logits = tl.where(scol < S, r * qdot, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    a = e / tl.sum(e, axis=1)[:, None]
    smask = ok2 & (scol < S)
    tl.store(R + rows2 * S + scol, r, mask=smask)
    tl.store(A + rows2 * S + scol, a, mask=smask)
    n = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:
        xx = tl.zeros([BLOCK_M], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            x = _mix(a, scol, V0, V1, V2, V3, V4, V5, V6, V7, rows2 * D + cols[None, :], ok2 & (cols[None, :] < D), S)
            xx += tl.sum(x * x, axis=1)
        n = 1.0 / tl.sqrt(xx / D + norm_eps)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = ok2 & (cols[None, :] < D)
        y = _mix(a, scol, V0, V1, V2, V3, V4, V5, V6, V7, rows2 * D + cols[None, :], mask, S)
        if NORM:
            y = y * n[:, None] * tl.load(NW + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        tl.store(O + rows2 * D + cols[None, :], y.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _attn_res_bwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7,
                         GI0, GI1, GI2, GI3, GI4, GI5, GI6, GI7, Q, NW, G, R, A, DQ, DNW, M, D, norm_eps,
                         S: tl.constexpr, S_PAD: tl.constexpr, NORM: tl.constexpr, GRAD_IN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """G is ∂L/∂x, or ∂L/∂y with NORM; DQ (and DNW) are [programs, D] fp32 buffers of zeros (added into).
    Bit i of GRAD_IN: GI_i holds a gradient that source i already has, added into DV_i."""
    pid = tl.program_id(0)
    scol = tl.arange(0, S_PAD)[None, :]
    dq_row = DQ + pid.to(tl.int64) * D
    dnw_row = DNW + pid.to(tl.int64) * D
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        rows2, ok2 = rows[:, None], row_ok[:, None]
        smask = ok2 & (scol < S)
        r = tl.load(R + rows2 * S + scol, mask=smask, other=0.0)
        a = tl.load(A + rows2 * S + scol, mask=smask, other=0.0)
        gdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)  # g·v_i, or (w_n ⊙ dy)·v_i with NORM
        qdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)
        xdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)  # x·v_i (NORM)
        xx = tl.zeros([BLOCK_M], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = ok2 & (cols[None, :] < D)
            offs = rows2 * D + cols[None, :]
            q = tl.load(Q + cols, mask=cols < D, other=0.0)[None, :]
            g = _load(G, offs, mask)
            if NORM:
                g = g * tl.load(NW + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
                x = _mix(a, scol, V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S)
                xx += tl.sum(x * x, axis=1)
            for i in tl.static_range(S):
                v = _load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7), offs, mask)
                gdot += tl.where(scol == i, tl.sum(v * g, axis=1)[:, None], 0.0)
                qdot += tl.where(scol == i, tl.sum(v * q, axis=1)[:, None], 0.0)
                if NORM:
                    xdot += tl.where(scol == i, tl.sum(v * x, axis=1)[:, None], 0.0)
        n = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        k = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:  # g = n (w_n ⊙ dy) − k x, with x · (w_n ⊙ dy) = Σ_i a_i (w_n ⊙ dy) · v_i
            n = 1.0 / tl.sqrt(xx / D + norm_eps)
            k = n * n * n * tl.sum(a * gdot, axis=1) / D
            gdot = n[:, None] * gdot - k[:, None] * xdot
        dl = a * (gdot - tl.sum(a * gdot, axis=1)[:, None])
        coef_q = dl * r  # dv_i = a_i g + coef_q_i q̃ − coef_v_i v_i;  dq̃ += coef_q_i v_i
        coef_v = coef_q * r * r * qdot / D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            mask = ok2 & cmask[None, :]
            offs = rows2 * D + cols[None, :]
            q = tl.load(Q + cols, mask=cmask, other=0.0)[None, :]
            g = _load(G, offs, mask)
            if NORM:
                x = _mix(a, scol, V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S)
                dnw = tl.sum(g * x * n[:, None], axis=0)
                tl.store(dnw_row + cols, tl.load(dnw_row + cols, mask=cmask, other=0.0) + dnw, mask=cmask)
                g = n[:, None] * g * tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] - k[:, None] * x
            dq = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i in tl.static_range(S):
                v = _load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7), offs, mask)
                cq = _column(coef_q, scol, i)[:, None]
                dv = _column(a, scol, i)[:, None] * g + cq * q - _column(coef_v, scol, i)[:, None] * v
                if (GRAD_IN >> i) & 1:
                    dv += _load(_pick(i, GI0, GI1, GI2, GI3, GI4, GI5, GI6, GI7), offs, mask)
                DVi = _pick(i, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7)
                tl.store(DVi + offs, dv.to(DVi.dtype.element_ty), mask=mask)
                dq += tl.sum(cq * v, axis=0)
            tl.store(dq_row + cols, tl.load(dq_row + cols, mask=cmask, other=0.0) + dq, mask=cmask)


@triton.jit
def _load_sources(V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S: tl.constexpr):
    """The S sources' [BLOCK_M, BLOCK_D] tiles at ``offs``, fp32, as eight values (slots past S repeat v0)."""
    v0 = _load(V0, offs, mask)
    v1, v2, v3, v4, v5, v6, v7 = v0, v0, v0, v0, v0, v0, v0
    if S > 1:
        v1 = _load(V1, offs, mask)
    if S > 2:
        v2 = _load(V2, offs, mask)
    if S > 3:
        v3 = _load(V3, offs, mask)
    if S > 4:
        v4 = _load(V4, offs, mask)
    if S > 5:
        v5 = _load(V5, offs, mask)
    if S > 6:
        v6 = _load(V6, offs, mask)
    if S > 7:
        v7 = _load(V7, offs, mask)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _add_to_last(v0, v1, v2, v3, v4, v5, v6, v7, res, S: tl.constexpr):
    """The eight tile values with ``res`` added to slot S − 1."""
    if S == 1:
        v0 += res
    if S == 2:
        v1 += res
    if S == 3:
        v2 += res
    if S == 4:
        v3 += res
    if S == 5:
        v4 += res
    if S == 6:
        v5 += res
    if S == 7:
        v6 += res
    if S == 8:
        v7 += res
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _dots(u, scol, v0, v1, v2, v3, v4, v5, v6, v7, S: tl.constexpr):
    """[BLOCK_M, S_PAD] tile of u · v_i per token."""
    out = tl.where(scol == 0, tl.sum(u * v0, axis=1)[:, None], 0.0)
    for i in tl.static_range(1, S):
        out += tl.where(scol == i, tl.sum(u * _pick(i, v0, v1, v2, v3, v4, v5, v6, v7), axis=1)[:, None], 0.0)
    return out


@triton.jit
def _mix_held(a, scol, v0, v1, v2, v3, v4, v5, v6, v7, S: tl.constexpr):
    """x = Σ_i a_i v_i of tiles held in registers."""
    x = _column(a, scol, 0)[:, None] * v0
    for i in tl.static_range(1, S):
        x += _column(a, scol, i)[:, None] * _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
    return x


@triton.jit
def _attn_res_fwd_rows_kernel(V0, V1, V2, V3, V4, V5, V6, V7, RES, PO, Q, NW, O, R, A, M, D, eps, norm_eps,
                              S: tl.constexpr, S_PAD: tl.constexpr, NORM: tl.constexpr, ADD_LAST: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The forward for rows that fit one tile (BLOCK_D ≥ D): every source read once into registers.
    With ADD_LAST the last source is V_{S-1} + RES, formed here and written to PO (fp32)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok2 = (rows < M)[:, None]
    cols = tl.arange(0, BLOCK_D)
    mask = ok2 & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    scol = tl.arange(0, S_PAD)[None, :]
    v0, v1, v2, v3, v4, v5, v6, v7 = _load_sources(V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S)
    if ADD_LAST:
        v0, v1, v2, v3, v4, v5, v6, v7 = _add_to_last(v0, v1, v2, v3, v4, v5, v6, v7, _load(RES, offs, mask), S)
        tl.store(PO + offs, _pick(S - 1, v0, v1, v2, v3, v4, v5, v6, v7).to(PO.dtype.element_ty), mask=mask)
    q = tl.load(Q + cols, mask=cols < D, other=0.0)[None, :]
    sumsq = tl.where(scol == 0, tl.sum(v0 * v0, axis=1)[:, None], 0.0)
    for i in tl.static_range(1, S):
        vi = _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
        sumsq += tl.where(scol == i, tl.sum(vi * vi, axis=1)[:, None], 0.0)
    r = 1.0 / tl.sqrt(sumsq / D + eps)
    logits = tl.where(scol < S, r * _dots(q, scol, v0, v1, v2, v3, v4, v5, v6, v7, S), float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    a = e / tl.sum(e, axis=1)[:, None]
    smask = ok2 & (scol < S)
    tl.store(R + rows[:, None] * S + scol, r, mask=smask)
    tl.store(A + rows[:, None] * S + scol, a, mask=smask)
    y = _mix_held(a, scol, v0, v1, v2, v3, v4, v5, v6, v7, S)
    if NORM:
        n = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + norm_eps)
        y = y * n[:, None] * tl.load(NW + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    tl.store(O + offs, y.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _attn_res_bwd_rows_kernel(V0, V1, V2, V3, V4, V5, V6, V7, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7,
                              GI0, GI1, GI2, GI3, GI4, GI5, GI6, GI7, DRES, Q, NW, G, R, A, DQ, DNW, M, D, norm_eps,
                              S: tl.constexpr, S_PAD: tl.constexpr, NORM: tl.constexpr, GRAD_IN: tl.constexpr,
                              ADD_LAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The backward for rows that fit one tile: every source and G read once; this program's dq̃ (and
    dw_n) summed in registers over its token blocks and written once to its row of DQ (DNW). With
    ADD_LAST (V_{S-1} is the forward's V_{S-1} + RES) the last source's gradient is also RES's: DRES."""
    pid = tl.program_id(0)
    scol = tl.arange(0, S_PAD)[None, :]
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    q = tl.load(Q + cols, mask=cmask, other=0.0)[None, :]
    nw = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dq = tl.zeros([BLOCK_D], dtype=tl.float32)
    dnw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok2 = (rows < M)[:, None]
        mask = ok2 & cmask[None, :]
        offs = rows[:, None] * D + cols[None, :]
        smask = ok2 & (scol < S)
        r = tl.load(R + rows[:, None] * S + scol, mask=smask, other=0.0)
        a = tl.load(A + rows[:, None] * S + scol, mask=smask, other=0.0)
        v0, v1, v2, v3, v4, v5, v6, v7 = _load_sources(V0, V1, V2, V3, V4, V5, V6, V7, offs, mask, S)
        g = _load(G, offs, mask)
        if NORM:  # g ← ∂L/∂x = n (w_n ⊙ dy) − n³ (x · (w_n ⊙ dy)/d) x
            x = _mix_held(a, scol, v0, v1, v2, v3, v4, v5, v6, v7, S)
            n = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + norm_eps)
            dnw += tl.sum(g * x * n[:, None], axis=0)
            wdy = g * nw
            k = n * n * n * tl.sum(x * wdy, axis=1) / D
            g = n[:, None] * wdy - k[:, None] * x
        gdot = _dots(g, scol, v0, v1, v2, v3, v4, v5, v6, v7, S)
        qdot = _dots(q, scol, v0, v1, v2, v3, v4, v5, v6, v7, S)
        dl = a * (gdot - tl.sum(a * gdot, axis=1)[:, None])
        coef_q = dl * r  # dv_i = a_i g + coef_q_i q̃ − coef_v_i v_i;  dq̃ += coef_q_i v_i
        coef_v = coef_q * r * r * qdot / D
        for i in tl.static_range(S):
            vi = _pick(i, v0, v1, v2, v3, v4, v5, v6, v7)
            cq = _column(coef_q, scol, i)[:, None]
            dv = _column(a, scol, i)[:, None] * g + cq * q - _column(coef_v, scol, i)[:, None] * vi
            if (GRAD_IN >> i) & 1:
                dv += _load(_pick(i, GI0, GI1, GI2, GI3, GI4, GI5, GI6, GI7), offs, mask)
            DVi = _pick(i, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7)
            tl.store(DVi + offs, dv.to(DVi.dtype.element_ty), mask=mask)
            if ADD_LAST and i == S - 1:
                tl.store(DRES + offs, dv.to(DRES.dtype.element_ty), mask=mask)
            dq += tl.sum(cq * vi, axis=0)
    tl.store(DQ + pid.to(tl.int64) * D + cols, dq, mask=cmask)
    if NORM:
        tl.store(DNW + pid.to(tl.int64) * D + cols, dnw, mask=cmask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_attn_res_fwd_kernel, InterpretedFunction)


def _launch(M: int, D: int, S: int, t: torch.Tensor, backward: bool) -> tuple[int, dict, bool]:
    """(number of programs, meta-parameters, whether the row kernels apply) for M tokens of d = D features
    and S sources."""
    if S < 1 or S > MAX_SOURCES:
        raise ValueError(f"the Triton AttnRes kernels take 1..{MAX_SOURCES} sources, got {S}")
    whole_row = max(16, triton.next_power_of_2(D))
    if t.is_cuda:
        rows = whole_row <= GPU_ROWS_MAX_D and (GPU_TILE_OVERRIDE is None or len(GPU_TILE_OVERRIDE) == 2)
        if rows:  # the default warps are for rows of up to 1024 features, and grow with the row
            bm, warps = GPU_TILE_OVERRIDE or (GPU_ROWS_TILE if S <= GPU_ROWS_FEW_SOURCES else GPU_ROWS_TILE_MANY)
            warps = warps if GPU_TILE_OVERRIDE else min(16, warps * max(1, whole_row // 1024))
            bd = whole_row
        else:
            bm, warps, bd = gpu_tile(S, D, backward)
        opts = {"num_warps": warps}
        per_sm = GPU_BWD_PROGRAMS_OVERRIDE or GPU_BWD_PROGRAMS_PER_SM
        max_programs = per_sm * torch.cuda.get_device_properties(t.device).multi_processor_count
    elif interpreter_active():
        rows = whole_row <= INTERPRET_ROWS_MAX_D
        (bm, bd), opts, max_programs = INTERPRET_BLOCKS, {}, INTERPRET_BWD_PROGRAMS
        bd = whole_row if rows else bd
    else:
        raise RuntimeError("the Triton AttnRes kernels got a CPU tensor, but Triton's interpreter is "
                           "off: set TRITON_INTERPRET=1 before triton is imported, or use "
                           "backend='torch'")
    meta = {"S": S, "S_PAD": max(2, triton.next_power_of_2(S)), "BLOCK_M": bm, "BLOCK_D": bd, **opts}
    blocks = triton.cdiv(M, bm)
    return (min(blocks, max_programs) if backward else blocks), meta, rows


def _slots(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` padded to MAX_SOURCES pointer arguments with ts[0] (never read past S)."""
    return list(ts) + [ts[0]] * (MAX_SOURCES - len(ts))


def attn_res_fwd(sources: list[torch.Tensor], qt: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 norm_eps: float = 0.0, out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """sources: S contiguous [M, d] tensors of one dtype; qt: contiguous fp32 [d] (w ⊙ γ); with
    ``norm_weight`` [d], the site's RMSNorm (eps ``norm_eps``) applied to the mix; with ``residual`` (a
    contiguous [M, d] of any float dtype) the last source is sources[-1] + residual, formed in the row
    kernel (elsewhere by torch first)
    → (out [M, d] in ``out_dtype``, default the sources' dtype; r [M, S] fp32; a [M, S] fp32; that last
    source in the sources' dtype, or None without ``residual``)."""
    M, D = sources[0].shape
    S, dev = len(sources), sources[0].device
    out = torch.empty((M, D), dtype=out_dtype or sources[0].dtype, device=dev)
    r = torch.empty((M, S), dtype=torch.float32, device=dev)
    a = torch.empty((M, S), dtype=torch.float32, device=dev)
    last = None
    if M * D == 0:
        return out, r, a, None if residual is None else (sources[-1] + residual).to(sources[-1].dtype)
    n, meta, rows = _launch(M, D, S, sources[0], backward=False)
    if residual is not None and not rows:
        last = (sources[-1] + residual).to(sources[-1].dtype)
        sources, residual = [*sources[:-1], last], None
    elif residual is not None:
        last = torch.empty_like(sources[-1])
    nw = qt if norm_weight is None else norm_weight  # any pointer without the norm
    if rows:
        _attn_res_fwd_rows_kernel[(n,)](*_slots(sources), qt if residual is None else residual,
                                        qt if last is None else last, qt, nw, out, r, a, M, D, RMS_EPS, norm_eps,
                                        NORM=norm_weight is not None, ADD_LAST=residual is not None, **meta)
    else:
        _attn_res_fwd_kernel[(n,)](*_slots(sources), qt, nw, out, r, a, M, D, RMS_EPS, norm_eps,
                                   NORM=norm_weight is not None, **meta)
    return out, r, a, last


def attn_res_bwd(sources: list[torch.Tensor], qt: torch.Tensor, grad_out: torch.Tensor,
                 r: torch.Tensor, a: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 norm_eps: float = 0.0, grad_in: list[torch.Tensor | None] | None = None,
                 residual_dtype: torch.dtype | None = None
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``attn_res_fwd``'s out (``grad_out``, a contiguous [M, d] in any float dtype):
    (dv_i [M, d] in the sources' dtype, dq̃ [d] fp32, the norm weight's gradient in its dtype or None, the
    residual's gradient or None). ``sources`` are those the forward mixed (with a residual: its last
    source, the sum). ``grad_in``: per source, None or a contiguous [M, d] gradient it already has from
    elsewhere, added into its dv_i in the kernel (one read instead of a separate add's two reads and a
    write). ``residual_dtype``: the forward had a residual of that dtype; its gradient is the last
    source's dv (written by the row kernel as it writes dv)."""
    M, D = sources[0].shape
    dvs = [torch.empty_like(v) for v in sources]
    grad_in = grad_in or [None] * len(sources)
    if M * D == 0:
        zeros = torch.zeros(D, dtype=torch.float32, device=qt.device)
        dres = None if residual_dtype is None else dvs[-1].to(residual_dtype)
        return dvs, zeros, None if norm_weight is None else zeros.to(norm_weight.dtype), dres
    n, meta, rows = _launch(M, D, len(sources), sources[0], backward=True)
    # the row kernels write each program's row once; the chunked ones add into it chunk by chunk
    parts = torch.empty if rows else torch.zeros
    dq_parts = parts((n, D), dtype=torch.float32, device=qt.device)
    dnw_parts = dq_parts if norm_weight is None else parts((n, D), dtype=torch.float32, device=qt.device)
    nw = qt if norm_weight is None else norm_weight
    has_in = sum(1 << i for i, gi in enumerate(grad_in) if gi is not None)
    args = (*_slots(sources), *_slots(dvs), *_slots([v if gi is None else gi for v, gi in zip(sources, grad_in)]))
    dres = None
    if rows:
        add_last = residual_dtype is not None
        dres = torch.empty(sources[-1].shape, dtype=residual_dtype, device=qt.device) if add_last else None
        _attn_res_bwd_rows_kernel[(n,)](*args, qt if dres is None else dres, qt, nw, grad_out, r, a, dq_parts,
                                        dnw_parts, M, D, norm_eps, NORM=norm_weight is not None, GRAD_IN=has_in,
                                        ADD_LAST=add_last, **meta)
    else:
        _attn_res_bwd_kernel[(n,)](*args, qt, nw, grad_out, r, a, dq_parts, dnw_parts, M, D, norm_eps,
                                   NORM=norm_weight is not None, GRAD_IN=has_in, **meta)
        dres = None if residual_dtype is None else dvs[-1].to(residual_dtype)
    dnw = None if norm_weight is None else dnw_parts.sum(0).to(norm_weight.dtype)
    return dvs, dq_parts.sum(0), dnw, dres
