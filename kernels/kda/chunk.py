"""Triton chunkwise KDA for training (forward and backward), K3 lower-bounded gate.

Design (docs/kda_notes.md has the derivation and the measured numbers):

* Chunk size C = 32.  The gate is >= lower_bound >= -5, so inside a chunk the
  cumulative log-decay G (per key channel) spans at most 5 * 32 = 160.  Every
  intra-chunk pair (r, s) is formed through ONE reference point, G_ref = G at row
  C/2 - 1, as (x_r e^{G_r - G_ref}) . (y_s e^{G_ref - G_s}); each factor is at
  most e^80, inside the fp32/bf16 range, so the C x C tiles are plain dense dot
  products (tensor cores), with no 16-token sub-blocking and no per-element exp.
* Four kernels:
    prep   (parallel over chunks):  L2 norm, beta sigmoid, gate activation and
           cumsum, A = tril(beta K K^T decayed), X = (I + A)^-1 (blocked forward
           substitution, stable for near-identical keys), WY factors Wk = X diag(beta) K e^G, U = X diag(beta) V,
           the intra-chunk q.k matrix M and the decayed q / k tiles; for the
           backward also k e^G, G at the reference row and at the chunk end, and
           1/|q|, 1/|k|, beta.
    fwd    (sequential over chunks, parallel over sequence, head, V tile):
           W = U - Wk S;  O = (q e^G) S + M W;  S <- e^{G_C} S + (k e^{G_C-G})^T W.
           Stores each chunk's start state h for the backward.
    bwd_h  (sequential, reverse): dW = M^T dO + Ke dS;
           dS <- (q e^G)^T dO + e^{G_C} dS - Wk^T dW.  Stores dS per chunk and dW.
    bwd    (parallel over chunks): all local gradients, chained back through
           the inverse, the decays, the gate activation, the sigmoid and the L2
           norm, to q, k, v, g, beta, and per-chunk partials of A_log / dt_bias.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from ..backend import eager_or_compiled
from .memo import TensorMemo

# Reductions call tl.reduce / tl.associative_scan with the stock sum combiner directly
# rather than tl.sum / tl.cumsum: identical code on the GPU, and under TRITON_INTERPRET
# it skips a per-call re-patching of triton.language that made the CPU tests ~10x slower.

CHUNK = 32
L2_EPS = 1e-6

# Launch configuration.  Defaults: H200 sweeps (docs/kda_notes.md) plus ptxas spill counts;
# benchmarks/kda.py --sweep times the alternatives and gates each on accuracy.
CONFIG = {
    "prep_warps": 4,      # kda_prep_kernel
    "seq_bv": None,       # V tile of the two scans (grid N x H x V/seq_bv); None: 128 when
                          # there are at least as many sequence-heads as SMs, else 64
    "seq_warps": None,    # None: seq_bv / 16
    "seq_stages": 3,
    "bwd_bv": 32,         # V tile looped over inside the parallel backward kernel
    "bwd_warps": 2,       # 255 registers: 4 CTAs per SM; 4 warps ran 1.28x, 8 warps 2.5x
                          # slower (H200 sweeps, docs/kda_notes.md runs 4-5)
    "bwd_bke": 16,            # key-channel block of the backward epilogue
    "bwd_bkl": 32,            # key-channel block of the L2-norm backward (last phase):
                              # 0.2 ms faster than 16 and 0.3 ms faster than 64 (run 7)
    "prep_inv_prec": "tf32x3",  # (I + A)^-1 block merges: 3-pass tf32 (~fp32), 0.2 ms
                                # faster than FMA ("ieee") in prep at 8x4096x32
    "bwd_inv_prec": "ieee",     # -X^T dX X^T: fp32 FMA, 0.17 ms faster than tf32x3 there
    "grad_prec": "bf16",      # intra-chunk backward dots feeding dg: bf16 operands (RNE),
                              # one tensor-core pass; or fp32 operands with "tf32x3" (~fp32),
                              # "tf32" (one pass; operands truncated, which biases the
                              # dA_log / dt_bias sums: 3e-2 rel. error at 2x2048x8) or "ieee"
}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _load_chunk_inputs(q, k, g, beta, A_log, dt_bias, bos, ln, i_h, lower_bound, scale,
                       H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                       USE_L2: tl.constexpr):
    """One chunk's activated inputs, fp32: scale * q / |q| and k / |k| [C, BK], the gate
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) [C, BK] (0 on padding), sigmoid(b),
    1/|q| and 1/|k| [C]."""
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    rv = r < ln
    km = ck < K
    m2 = rv[:, None] & km[None, :]
    off = (bos + r).to(tl.int64)[:, None] * (H * K) + i_h * K + ck[None, :]
    bq = tl.load(q + off, mask=m2, other=0.).to(tl.float32)
    bk = tl.load(k + off, mask=m2, other=0.).to(tl.float32)
    bg = tl.load(g + off, mask=m2, other=0.).to(tl.float32)
    bb = tl.load(beta + (bos + r).to(tl.int64) * H + i_h, mask=rv, other=0.).to(tl.float32)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dt = tl.load(dt_bias + i_h * K + ck, mask=km, other=0.).to(tl.float32)
    x = a * (bg + dt[None, :])
    sig = 1. / (1. + tl.exp(-x))
    gate = tl.where(m2, lower_bound * sig, 0.)
    beta_s = tl.where(rv, 1. / (1. + tl.exp(-bb)), 0.)
    if USE_L2:
        rq = tl.rsqrt(tl.reduce(bq * bq, 1, _sum_combine) + 1e-6)
        rk = tl.rsqrt(tl.reduce(bk * bk, 1, _sum_combine) + 1e-6)
    else:
        rq = tl.full([C], 1.0, tl.float32)
        rk = tl.full([C], 1.0, tl.float32)
    return bq * (rq * scale)[:, None], bk * rk[:, None], gate, beta_s, rq, rk


@triton.jit
def _tri_inverse(A, r, C: tl.constexpr, INV_PREC: tl.constexpr):
    blk8 = (r[:, None] // 8) == (r[None, :] // 8)
    diag = r[:, None] == r[None, :]
    Ad = tl.where(blk8, A, 0.)
    Y = tl.where(diag, 1., 0.)
    for i in range(1, 8):
        sel = (r % 8) == i
        a_i = tl.reduce(tl.where(sel[:, None], Ad, 0.), 0, _sum_combine)
        row = -tl.reduce(a_i[:, None] * Y, 0, _sum_combine)
        Y = tl.where(sel[:, None] & blk8, tl.where(diag, 1., row[None, :]), Y)
    blk16 = (r[:, None] // 16) == (r[None, :] // 16)
    A1 = tl.where(blk16 & ((r[:, None] // 8) != (r[None, :] // 8)), A, 0.)
    Y = Y - tl.dot(tl.dot(Y, A1, input_precision=INV_PREC), Y, input_precision=INV_PREC)
    if C > 16:
        A2 = tl.where((r[:, None] // 16) != (r[None, :] // 16), A, 0.)
        Y = Y - tl.dot(tl.dot(Y, A2, input_precision=INV_PREC), Y, input_precision=INV_PREC)
    return Y


@triton.jit
def _chunk_program(chunk_seq, chunk_bos, cu):
    """Program (chunk i_c, head i_h) of a per-chunk kernel: the chunk's first token and its
    valid length (< C for a document's last chunk)."""
    i_c = tl.program_id(0)
    n = tl.load(chunk_seq + i_c)
    bos = tl.load(chunk_bos + i_c)
    return i_c, tl.program_id(1), bos, tl.load(cu + n + 1) - bos


@triton.jit
def kda_prep_kernel(q, k, v, g, beta, A_log, dt_bias,
                    chunk_seq, chunk_bos, cu,
                    Wk, U, Qd, Ke, Kd, Mqk, Xinv, GS, RS,
                    lower_bound, scale,
                    H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
                    DT: tl.constexpr, INV_PREC: tl.constexpr):
    i_c, i_h, bos, ln = _chunk_program(chunk_seq, chunk_bos, cu)
    if ln <= 0:  # an empty slot past the last packed document: no scan reads it
        return
    qs, kn, gate, bb, rq, rk = _load_chunk_inputs(
        q, k, g, beta, A_log, dt_bias, bos, ln, i_h, lower_bound, scale, H, K, C, BK, USE_L2)
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    G = tl.associative_scan(gate, 0, _sum_combine)
    g_ref = tl.reduce(tl.where(r[:, None] == (C // 2 - 1), G, 0.), 0, _sum_combine)
    g_last = tl.reduce(tl.where(r[:, None] == (C - 1), G, 0.), 0, _sum_combine)
    e_in = tl.exp(G - g_ref[None, :])          # <= e^80
    e_out = tl.exp(g_ref[None, :] - G)         # <= e^80
    Ki = (kn * e_in).to(DT)
    Kh = (kn * e_out).to(DT)
    Qi = (qs * e_in).to(DT)
    incl = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    A = tl.dot(Ki, tl.trans(Kh))
    A = tl.where(strict, A * bb[:, None], 0.)
    Mm = tl.where(incl, tl.dot(Qi, tl.trans(Kh)), 0.)
    # X = (I + A)^-1 (A strictly lower): forward substitution inside 8 x 8 diagonal blocks,
    # the four blocks at once (their rows have disjoint column supports), then two exact
    # block merges  [[Y1, 0], [B, Y2]]^-1 = Y - Y A_off Y  (8 -> 16 -> 32), in fp32.
    X = _tri_inverse(A, r, C, INV_PREC)
    Tm = X * bb[None, :]
    e_G = tl.exp(G)
    KdD = (kn * e_G).to(DT)
    Qdd = qs * e_G
    Kee = kn * tl.exp(g_last[None, :] - G)
    TmD = Tm.to(DT)
    WkT = tl.dot(TmD, KdD)
    base = (i_c * H + i_h).to(tl.int64)
    okc = base * (C * BK) + r[:, None] * BK + ck[None, :]
    tl.store(Wk + okc, WkT.to(Wk.dtype.element_ty))
    tl.store(Qd + okc, Qdd.to(Qd.dtype.element_ty))
    tl.store(Ke + okc, Kee.to(Ke.dtype.element_ty))
    tl.store(Kd + okc, KdD.to(Kd.dtype.element_ty))
    occ = base * (C * C) + r[:, None] * C + r[None, :]
    tl.store(Mqk + occ, Mm.to(Mqk.dtype.element_ty))
    tl.store(Xinv + occ, X)
    gs = base * (3 * BK) + ck
    tl.store(GS + gs, tl.exp(g_last))
    tl.store(GS + gs + BK, g_ref)
    tl.store(GS + gs + 2 * BK, g_last)
    rs = base * (3 * C) + r
    tl.store(RS + rs, rq)
    tl.store(RS + rs + C, rk)
    tl.store(RS + rs + 2 * C, bb)
    rv = r < ln
    for iv in range(0, (V + BV - 1) // BV):
        cv = iv * BV + tl.arange(0, BV)
        vm = rv[:, None] & (cv[None, :] < V)
        bv = tl.load(v + (bos + r).to(tl.int64)[:, None] * (H * V) + i_h * V + cv[None, :],
                     mask=vm, other=0.)
        Ut = tl.dot(TmD, bv.to(DT))
        tl.store(U + base * (C * V) + r[:, None] * V + cv[None, :], Ut.to(U.dtype.element_ty),
                 mask=cv[None, :] < V)


@triton.jit
def _scan_start(state0, HAS_STATE: tl.constexpr, chunk_off, cu, H, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (sequence i_n, head i_h, V tile i_v) of a sequential scan: its [BK, BV] state
    tile (state0 or zeros, fp32), the state's offsets and mask, and its chunk range."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    ck = tl.arange(0, BK)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = cv < V
    sm = (ck < K)[:, None] & vm[None, :]
    s_off = (i_n * H + i_h).to(tl.int64) * (K * V) + ck[:, None] * V + cv[None, :]
    if HAS_STATE:
        S = tl.load(state0 + s_off, mask=sm, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    c0 = tl.load(chunk_off + i_n)
    c1 = tl.load(chunk_off + i_n + 1)
    eos = tl.load(cu + i_n + 1)
    return i_h, ck, cv, vm, sm, s_off, S, c0, c1, eos


@triton.jit
def _scan_step_tiles(c, i_h, S, states, Wk, Qd, Ke, Mqk, GS, chunk_bos, eos, ck, cv, vm,
                     H, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Chunk c of a scan: store the state entering it (h or dh), load its prep tiles
    (Wk, q~, ke [C, BK], M [C, C], e^{G_C} [BK] from GS) and its token rows."""
    r = tl.arange(0, C)
    base = (c * H + i_h).to(tl.int64)
    tl.store(states + base * (BK * V) + ck[:, None] * V + cv[None, :],
             S.to(states.dtype.element_ty), mask=vm[None, :])
    okc = base * (C * BK) + r[:, None] * BK + ck[None, :]
    bWk = tl.load(Wk + okc)
    bQd = tl.load(Qd + okc)
    bKe = tl.load(Ke + okc)
    bM = tl.load(Mqk + base * (C * C) + r[:, None] * C + r[None, :])
    gl = tl.load(GS + base * (3 * BK) + ck)
    bos = tl.load(chunk_bos + c)
    rows = (bos + r).to(tl.int64)[:, None] * (H * V) + i_h * V + cv[None, :]
    rmask = ((bos + r) < eos)[:, None] & vm[None, :]
    return base, bWk, bQd, bKe, bM, gl, rows, rmask


@triton.jit
def kda_fwd_kernel(Wk, U, Qd, Ke, Mqk, GS, h0, o, h, ht,
                   chunk_off, chunk_bos, cu,
                   H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                   STORE_FINAL: tl.constexpr, DT: tl.constexpr):
    """Forward scan over the chunks of one sequence: S_C = e^{G_C} S0 + ke^T W with
    W = U - Wk S0, O = q~ S0 + M W; stores each chunk's entering state in h (bf16)."""
    i_h, ck, cv, vm, sm, s_off, S, c0, c1, eos = _scan_start(h0, HAS_H0, chunk_off, cu, H, K,
                                                              V, BK, BV)
    r = tl.arange(0, C)
    for c in range(c0, c1):
        base, bWk, bQd, bKe, bM, gl, rows, rmask = _scan_step_tiles(
            c, i_h, S, h, Wk, Qd, Ke, Mqk, GS, chunk_bos, eos, ck, cv, vm, H, V, C, BK)
        bU = tl.load(U + base * (C * V) + r[:, None] * V + cv[None, :], mask=vm[None, :],
                     other=0.).to(tl.float32)
        Sb = S.to(DT)
        W = bU - tl.dot(bWk.to(DT), Sb)
        Wb = W.to(DT)
        O = tl.dot(bQd.to(DT), Sb) + tl.dot(bM.to(DT), Wb)
        tl.store(o + rows, O.to(o.dtype.element_ty), mask=rmask)
        S = gl[:, None] * S + tl.dot(tl.trans(bKe.to(DT)), Wb)
    if STORE_FINAL:
        tl.store(ht + s_off, S, mask=sm)


@triton.jit
def kda_bwd_h_kernel(Wk, Qd, Ke, Mqk, GS, dht, do, dh, dW, dh0,
                     chunk_off, chunk_bos, cu,
                     H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr,
                     STORE_DH0: tl.constexpr, DT: tl.constexpr):
    """Reverse scan of dS: dW = M^T dO + ke dS_C, dS0 = e^{G_C} dS_C + q~^T dO - Wk^T dW;
    stores each chunk's dS_C in dh (bf16) and dW."""
    i_h, ck, cv, vm, sm, s_off, dS, c0, c1, eos = _scan_start(dht, HAS_DHT, chunk_off, cu, H,
                                                               K, V, BK, BV)
    r = tl.arange(0, C)
    for j in range(0, c1 - c0):
        c = c1 - 1 - j
        base, bWk, bQd, bKe, bM, gl, rows, rmask = _scan_step_tiles(
            c, i_h, dS, dh, Wk, Qd, Ke, Mqk, GS, chunk_bos, eos, ck, cv, vm, H, V, C, BK)
        bdo = tl.load(do + rows, mask=rmask, other=0.).to(DT)
        dSb = dS.to(DT)
        bdW = tl.dot(tl.trans(bM.to(DT)), bdo) + tl.dot(bKe.to(DT), dSb)
        dWb = bdW.to(DT)
        tl.store(dW + base * (C * V) + r[:, None] * V + cv[None, :], bdW.to(dW.dtype.element_ty),
                 mask=vm[None, :])
        dS = gl[:, None] * dS + tl.dot(tl.trans(bQd.to(DT)), bdo) - tl.dot(tl.trans(bWk.to(DT)), dWb)
    if STORE_DH0:
        tl.store(dh0 + s_off, dS, mask=sm)


@triton.jit
def kda_bwd_kernel(q, k, v, g, beta, A_log, dt_bias,
                   chunk_seq, chunk_bos, cu,
                   Wk, U, Kd, Xinv, GS, RS, h, dh, dW, do,
                   dq, dk, dv, dg, dbeta, dA_part, ddt_part, scr, wscr,
                   lower_bound, scale,
                   H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BKE: tl.constexpr, BKL: tl.constexpr,
                   USE_L2: tl.constexpr, DT: tl.constexpr, GP: tl.constexpr, GPREC: tl.constexpr,
                   INV_PREC: tl.constexpr):
    """Per-chunk backward.  Phase 1 contracts over V with full-K tiles (W - k~ S0, R, dv,
    dM, dT) and keeps W - k~ S0 and dR in a per-program bf16 scratch [2C, V]; phase 2 walks
    the key channels in blocks of BKE, contracting over V for that block only (dq~, dk~,
    dke, d e^{G_C}), so no C x K accumulator is live across a loop; everything else there
    is per channel except three row / C x C sums.  Phase 3 applies the L2-norm backward,
    in key blocks of BKL, to the pre-norm gradients that phase 2 left in an fp32 scratch
    [2C, BK].  Prep supplies k e^G, G_ref, G_C, 1/|q|, 1/|k| and beta."""
    i_c, i_h, bos, ln = _chunk_program(chunk_seq, chunk_bos, cu)
    if ln <= 0:  # an empty slot past the last packed document: no token, zero partial sums
        empty = (i_c * H + i_h).to(tl.int64)
        tl.store(dA_part + empty, 0.)
        tl.store(ddt_part + empty * BK + tl.arange(0, BK), tl.zeros([BK], dtype=tl.float32))
        return
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    rv = r < ln
    tok = (bos + r).to(tl.int64)
    base = (i_c * H + i_h).to(tl.int64)
    occ = base * (C * C) + r[:, None] * C + r[None, :]
    okc = base * (C * BK) + r[:, None] * BK + ck[None, :]
    # ---- phase 1: contractions over V (needs k e^G, T, Wk with full K, all from prep)
    rs = base * (3 * C) + r
    rq = tl.load(RS + rs)
    rk = tl.load(RS + rs + C)
    bb = tl.load(RS + rs + 2 * C)
    KdD = tl.load(Kd + okc).to(DT)
    X = tl.load(Xinv + occ)
    TmD = (X * bb[None, :]).to(DT)
    bWk = tl.load(Wk + okc).to(DT)
    dM = tl.zeros([C, C], dtype=tl.float32)
    dT = tl.zeros([C, C], dtype=tl.float32)
    wbase = base * (2 * C * V)  # per-program bf16 scratch: W - k~ S0 and dR, [C, V] each
    for iv in range(0, (V + BV - 1) // BV):
        cv = iv * BV + tl.arange(0, BV)
        vm = cv < V
        S0 = tl.load(h + base * (BK * V) + ck[:, None] * V + cv[None, :], mask=vm[None, :],
                     other=0.).to(DT)
        cvo = base * (C * V) + r[:, None] * V + cv[None, :]
        bU = tl.load(U + cvo, mask=vm[None, :], other=0.).to(tl.float32)
        bdW = tl.load(dW + cvo, mask=vm[None, :], other=0.).to(DT)
        tv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        m2 = rv[:, None] & vm[None, :]
        bdo = tl.load(do + tv, mask=m2, other=0.).to(DT)
        bv = tl.load(v + tv, mask=m2, other=0.).to(tl.float32)
        WD = (bU - tl.dot(bWk, S0)).to(DT)
        dM += tl.dot(bdo, tl.trans(WD))
        dR = tl.dot(tl.trans(TmD), bdW)
        tl.store(dv + tv, dR.to(dv.dtype.element_ty), mask=m2)
        R = bv - tl.dot(KdD, S0)
        dT += tl.dot(bdW, tl.trans(R.to(DT)))
        wo = wbase + r[:, None] * V + cv[None, :]
        tl.store(wscr + wo, WD, mask=vm[None, :])
        tl.store(wscr + C * V + wo, dR.to(DT), mask=vm[None, :])
    sbase = base * (2 * C * BK)
    # ---- C x C part: T = X diag(beta), X = (I + A)^-1
    incl = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    dbv = tl.reduce(dT * X, 0, _sum_combine)
    dX = dT * bb[None, :]
    dL = -tl.dot(tl.dot(tl.trans(X), dX, input_precision=INV_PREC), tl.trans(X),
                 input_precision=INV_PREC)
    dA = tl.where(strict, dL, 0.)
    dMG = tl.where(incl, dM, 0.).to(GP)
    dAb = (dA * bb[:, None]).to(GP)
    tl.debug_barrier()
    # ---- phase 2: per key-channel block
    ae = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    Gm = tl.zeros([C, C], dtype=tl.float32)
    sq = tl.zeros([C], dtype=tl.float32)
    sk = tl.zeros([C], dtype=tl.float32)
    dAl = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, BK // BKE):
        ce = kb * BKE + tl.arange(0, BKE)
        km = ce < K
        m2k = rv[:, None] & km[None, :]
        tk = tok[:, None] * (H * K) + i_h * K + ce[None, :]
        bq = tl.load(q + tk, mask=m2k, other=0.).to(tl.float32)
        bk_ = tl.load(k + tk, mask=m2k, other=0.).to(tl.float32)
        bg = tl.load(g + tk, mask=m2k, other=0.).to(tl.float32)
        dtb = tl.load(dt_bias + i_h * K + ce, mask=km, other=0.).to(tl.float32)
        xe = ae * (bg + dtb[None, :])
        sg = 1. / (1. + tl.exp(-xe))
        G = tl.associative_scan(tl.where(m2k, lower_bound * sg, 0.), 0, _sum_combine)
        g_ref = tl.load(GS + base * (3 * BK) + BK + ce)
        g_last = tl.load(GS + base * (3 * BK) + 2 * BK + ce)
        qb = bq * (rq * scale)[:, None]
        kb_ = bk_ * rk[:, None]
        e_in = tl.exp(G - g_ref[None, :])
        e_out = tl.exp(g_ref[None, :] - G)
        Ki = (kb_ * e_in).to(GP)
        Kh = (kb_ * e_out).to(GP)
        Qi = (qb * e_in).to(GP)
        Gm += tl.dot(Ki, tl.trans(Kh), input_precision=GPREC)
        dQi = tl.dot(dMG, Kh, input_precision=GPREC)
        dKi = tl.dot(dAb, Kh, input_precision=GPREC)
        dKh = tl.dot(tl.trans(dMG), Qi, input_precision=GPREC) + \
            tl.dot(tl.trans(dAb), Ki, input_precision=GPREC)
        dqs = dQi * e_in
        dkn = dKi * e_in + dKh * e_out
        dG = dQi * Qi.to(tl.float32) + dKi * Ki.to(tl.float32) - dKh * Kh.to(tl.float32)
        # contractions over V for this key block: do S0^T, -dR S0^T, (W - k~ S0) dS_C^T
        bdQd = tl.zeros([C, BKE], dtype=tl.float32)
        bdKd = tl.zeros([C, BKE], dtype=tl.float32)
        bdKe = tl.zeros([C, BKE], dtype=tl.float32)
        dgl = tl.zeros([BKE], dtype=tl.float32)
        for iv in range(0, (V + BV - 1) // BV):
            cv = iv * BV + tl.arange(0, BV)
            vm = cv < V
            hv = base * (BK * V) + ce[:, None] * V + cv[None, :]
            S0 = tl.load(h + hv, mask=vm[None, :], other=0.).to(DT)
            dSC = tl.load(dh + hv, mask=vm[None, :], other=0.).to(DT)
            tv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
            bdo = tl.load(do + tv, mask=rv[:, None] & vm[None, :], other=0.).to(DT)
            wo = wbase + r[:, None] * V + cv[None, :]
            WD = tl.load(wscr + wo, mask=vm[None, :], other=0.).to(DT)  # (bf16 scratch: DT is fp32 under
            dR = tl.load(wscr + C * V + wo, mask=vm[None, :], other=0.).to(DT)  # the interpreter)
            bdQd += tl.dot(bdo, tl.trans(S0))
            bdKd -= tl.dot(dR, tl.trans(S0))
            bdKe += tl.dot(WD, tl.trans(dSC))
            dgl += tl.reduce(S0.to(tl.float32) * dSC.to(tl.float32), 1, _sum_combine)
        sob = r[:, None] * BK + ce[None, :]
        e_G = tl.exp(G)
        dqs += bdQd * e_G
        dkn += bdKd * e_G
        dG += (bdQd * qb + bdKd * kb_) * e_G
        e_E = tl.exp(g_last[None, :] - G)
        dkn += bdKe * e_E
        dKeKe = bdKe * kb_ * e_E
        dG -= dKeKe
        dgC = tl.reduce(dKeKe, 0, _sum_combine) + tl.exp(g_last) * dgl
        dG += tl.where(r[:, None] == C - 1, dgC[None, :], 0.)
        dgate = tl.reduce(dG, 0, _sum_combine)[None, :] - tl.associative_scan(dG, 0, _sum_combine) + dG
        dx = tl.where(m2k, dgate * (lower_bound * sg) * (1. - sg), 0.)
        dgr = dx * ae
        tl.store(dg + tk, dgr.to(dg.dtype.element_ty), mask=m2k)
        dAl += tl.reduce(dx * xe, 1, _sum_combine)
        tl.store(ddt_part + base * BK + ce, tl.reduce(dgr, 0, _sum_combine))
        dqn = dqs * scale
        sq += tl.reduce(bq * rq[:, None] * dqn, 1, _sum_combine)
        sk += tl.reduce(kb_ * dkn, 1, _sum_combine)
        tl.store(scr + sbase + sob, dqn)
        tl.store(scr + sbase + C * BK + sob, dkn)
    tl.store(dA_part + base, tl.reduce(dAl, 0, _sum_combine))
    dbv += tl.reduce(dA * tl.where(strict, Gm, 0.), 1, _sum_combine)
    tl.store(dbeta + tok * H + i_h, (dbv * bb * (1. - bb)).to(dbeta.dtype.element_ty), mask=rv)
    tl.debug_barrier()
    # ---- phase 3: L2-norm backward, dx = (dy - y (y . dy)) / |x|
    for kb in range(0, BK // BKL):
        ce = kb * BKL + tl.arange(0, BKL)
        km = ce < K
        m2k = rv[:, None] & km[None, :]
        tk = tok[:, None] * (H * K) + i_h * K + ce[None, :]
        sob = r[:, None] * BK + ce[None, :]
        dqn = tl.load(scr + sbase + sob)
        dkn = tl.load(scr + sbase + C * BK + sob)
        if USE_L2:
            qy = tl.load(q + tk, mask=m2k, other=0.).to(tl.float32) * rq[:, None]
            ky = tl.load(k + tk, mask=m2k, other=0.).to(tl.float32) * rk[:, None]
            dqn = (dqn - qy * sq[:, None]) * rq[:, None]
            dkn = (dkn - ky * sk[:, None]) * rk[:, None]
        tl.store(dq + tk, dqn.to(dq.dtype.element_ty), mask=m2k)
        tl.store(dk + tk, dkn.to(dk.dtype.element_ty), mask=m2k)


# --------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------


def chunk_capacity(T: int, N: int, seq_len: int | None) -> int:
    """Rows of the per-chunk buffers: the exact chunk count N·⌈seq_len/C⌉ for N sequences of equal
    length, else an upper bound of Σ_n ⌈len_n/C⌉ over N packed documents of T tokens in all
    (⌈l/C⌉ ≤ (l + C − 1)/C sums to at most T//C + N). Known from shapes alone, so the host never
    reads the document lengths (no sync) and ``torch.compile`` sees static buffer shapes."""
    if seq_len is not None:
        return N * ((seq_len + CHUNK - 1) // CHUNK)
    return T // CHUNK + N


def _chunk_tables(cu: torch.Tensor, C: int, seq_len: int | None, rows: int):
    """cu: int64 [N+1] on device, ``rows`` = ``chunk_capacity``.  Returns chunk_seq, chunk_bos
    (int32 [rows]), chunk_off (int32 [N+1]) and rows, from shapes alone (no host sync).  Equal
    lengths (seq_len given): every slot is a chunk.  Packed documents: the documents fill the
    first Σ_n ⌈len_n/C⌉ slots, the rest are empty chunks (chunk_bos at or past the end of the
    last document), whose programs return at once in the per-chunk kernels."""
    N = cu.numel() - 1
    if seq_len is not None:
        nt = (seq_len + C - 1) // C
        idx = torch.arange(N * nt, device=cu.device, dtype=torch.int32)
        seq = idx // nt
        bos = seq * seq_len + (idx % nt) * C
        off = torch.arange(N + 1, device=cu.device, dtype=torch.int32) * nt
        return seq, bos, off, N * nt
    lens = cu[1:] - cu[:-1]
    off = torch.cat([cu.new_zeros(1), torch.cumsum((lens + C - 1) // C, 0)])
    idx = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(off[1:], idx, right=True).clamp_(max=N - 1)
    bos = cu[seq] + (idx - off[seq]) * C
    return seq.to(torch.int32), bos.to(torch.int32), off.to(torch.int32), rows


_TABLES = TensorMemo()  # cu (int64, on the device) → its chunk tables and int32 copy


def _tables(cu: torch.Tensor, C: int, seq_len: int | None, rows: int, memo: bool):
    """``_chunk_tables`` and cu as int32: with ``memo`` (eager ``KDAFunction``), computed once per cu
    tensor (every KDA layer of a forward gets the same one from ``kda_triton``); otherwise directly
    (the custom op that compiled graphs hold)."""

    def make():
        return (*_chunk_tables(cu, C, seq_len, rows), cu.to(torch.int32))

    return _TABLES.get(cu, (C, seq_len, rows), make) if memo else make()


_OFFSETS = TensorMemo()  # cu_seqlens → its int64 copy on the device
_EQUAL_OFFSETS: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # (B, T, device) → [0, T, …, B·T]


def _offsets(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """Document offsets as int64 on ``device``: ``cu_seqlens``, or every row one sequence of T. The
    same tensor for every call with the same input, so that ``_tables`` computes once per forward."""
    if torch.compiler.is_compiling():
        if cu_seqlens is None:
            return torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        return cu_seqlens.to(device=device, dtype=torch.int64)
    if cu_seqlens is None:
        key = (B, T, device)
        if key not in _EQUAL_OFFSETS:
            _EQUAL_OFFSETS[key] = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        return _EQUAL_OFFSETS[key]
    if cu_seqlens.dtype == torch.int64 and cu_seqlens.device == device:
        return cu_seqlens  # (a memo value must not hold its own key alive)
    return _OFFSETS.get(cu_seqlens, device, lambda: cu_seqlens.to(device=device, dtype=torch.int64))


def _dot_dtype(x: torch.Tensor):
    if _interpret() or x.dtype == torch.float32 or x.dtype == torch.float64:
        return tl.float32
    return tl.bfloat16  # fp16 cannot hold the e^80 factors; bf16 has fp32's range


def _store_dtype(x: torch.Tensor):
    return torch.float32 if x.dtype in (torch.float32, torch.float64) else torch.bfloat16


def _pick(V, key):
    return min(CONFIG[key], max(16, triton.next_power_of_2(V)))


def _scan_launch(N, H, V, dev):
    """(V tile, warps, stages) of the two sequential scans, whose grid is N x H x V/tile.
    A whole-V tile reads each chunk's prep tiles (Wk, q~, ke, M) once instead of once per
    tile, but leaves N x H programs, which pays only when they fill the GPU (H200 sweep,
    docs/kda_notes.md run 7)."""
    bv = CONFIG["seq_bv"]
    if bv is None:
        on_gpu = dev.type == "cuda"
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 1
        bv = 128 if N * H >= sms else 64
    bv = min(bv, max(16, triton.next_power_of_2(V)))
    return bv, CONFIG["seq_warps"] or max(1, bv // 16), CONFIG["seq_stages"]


def kda_fwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, h0, cu, use_l2,
            output_final_state, seq_len=None, memo=True):
    """The per-chunk buffers have ``chunk_capacity`` rows, known from shapes: no host sync (eager or
    under torch.compile), at the cost of up to N empty chunk slots for N packed documents.
    ``memo=False`` (the compiled graphs' custom op): nothing allocated here outlives the call. A
    compiled graph may run while a CUDA graph records, and a remembered table would be a tensor of
    the graph's memory pool that no graph output accounts for (CUDA graph trees refuse to go on)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    BK = max(16, triton.next_power_of_2(K))
    BV = _pick(V, "bwd_bv")
    dev = q.device
    N = cu.numel() - 1
    seq, bos, off, NC, cu32 = _tables(cu, C, seq_len, chunk_capacity(B * T, N, seq_len), memo)
    SBV, s_warps, s_stages = _scan_launch(N, H, V, dev)
    DT = _dot_dtype(q)
    Wk, U, Qd, Ke, Kd, M, X, GS, RS, hs = _chunk_buffers(q, v, NC)
    kda_prep_kernel[(NC, H)](q, k, v, g, beta, A_log, dt_bias, seq, bos, cu32,
                             Wk, U, Qd, Ke, Kd, M, X, GS, RS, float(lower_bound),
                             float(scale),
                             H=H, K=K, V=V, C=C, BK=BK, BV=BV, USE_L2=use_l2, DT=DT,
                             INV_PREC=CONFIG["prep_inv_prec"], num_warps=CONFIG["prep_warps"])
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    kda_fwd_kernel[(N, H, triton.cdiv(V, SBV))](
        Wk, U, Qd, Ke, M, GS, h0 if h0 is not None else o, o, hs, ht if ht is not None else o,
        off, bos, cu32, H=H, K=K, V=V, C=C, BK=BK, BV=SBV, HAS_H0=h0 is not None,
        STORE_FINAL=output_final_state, DT=DT, num_warps=s_warps, num_stages=s_stages)
    saved = (Wk, U, Qd, Ke, Kd, M, X, GS, RS, hs, seq, bos, off, cu32)
    return o, ht, saved


def _chunk_buffers(q: torch.Tensor, v: torch.Tensor, NC: int) -> tuple[torch.Tensor, ...]:
    """The per-chunk buffers prep and the forward scan fill for the backward, NC rows each:
    Wk, U, q~ (Qd), ke, k e^G (Kd), M, X = (I + A)^-1, GS = (e^{G_C}, G_ref, G_C) and
    RS = (1/|q|, 1/|k|, beta) per row, and the state h entering each chunk."""
    _, _, H, K = q.shape
    V, C, BK = v.shape[-1], CHUNK, max(16, triton.next_power_of_2(K))
    st, f32 = _store_dtype(q), torch.float32

    def new(*shape, dtype=st):
        return torch.empty(shape, device=q.device, dtype=dtype)

    return (new(NC, H, C, BK), new(NC, H, C, V), new(NC, H, C, BK), new(NC, H, C, BK), new(NC, H, C, BK),
            new(NC, H, C, C), new(NC, H, C, C, dtype=f32), new(NC, H, 3, BK, dtype=f32),
            new(NC, H, 3, C, dtype=f32), new(NC, H, BK, V))


def kda_bwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, has_h0, use_l2, saved,
            do, dht):
    Wk, U, Qd, Ke, Kd, M, X, GS, RS, hs, seq, bos, off, cu32 = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    BK = Wk.shape[-1]
    BV = _pick(V, "bwd_bv")
    NC = Wk.shape[0]
    N = off.numel() - 1
    dev = q.device
    SBV, s_warps, s_stages = _scan_launch(N, H, V, dev)
    DT = _dot_dtype(q)
    prec = CONFIG["grad_prec"]
    if prec not in ("bf16", "tf32x3", "tf32", "ieee"):
        raise ValueError(f"CONFIG['grad_prec'] = {prec!r}: use bf16, tf32x3, tf32 or ieee")
    if prec == "bf16" and DT == tl.bfloat16:
        GP, GPREC = tl.bfloat16, "tf32"  # (input_precision is moot for bf16 operands)
    else:  # fp32 operands (fp32 inputs take tf32x3 where bf16 was asked for)
        GP, GPREC = tl.float32, ("tf32x3" if prec == "bf16" else prec)
    do = do.contiguous()
    dhs = torch.empty_like(hs)
    dW = torch.empty_like(U)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if has_h0 else None
    if dht is not None:
        dht = dht.contiguous().float()
    kda_bwd_h_kernel[(N, H, triton.cdiv(V, SBV))](
        Wk, Qd, Ke, M, GS, dht if dht is not None else do, do, dhs, dW,
        dh0 if dh0 is not None else do, off, bos, cu32,
        H=H, K=K, V=V, C=C, BK=BK, BV=SBV, HAS_DHT=dht is not None, STORE_DH0=has_h0, DT=DT,
        num_warps=s_warps, num_stages=s_stages)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    db = torch.empty_like(beta)
    dA_part = torch.empty(NC, H, device=dev, dtype=torch.float32)
    ddt_part = torch.empty(NC, H, BK, device=dev, dtype=torch.float32)
    scr = torch.empty(NC, H, 2 * C, BK, device=dev, dtype=torch.float32)
    wscr = torch.empty(NC, H, 2 * C, V, device=dev, dtype=_store_dtype(q))
    BKE = min(CONFIG["bwd_bke"], BK)
    BKL = min(CONFIG["bwd_bkl"], BK)
    kda_bwd_kernel[(NC, H)](q, k, v, g, beta, A_log, dt_bias, seq, bos, cu32,
                            Wk, U, Kd, X, GS, RS, hs, dhs, dW, do,
                            dq, dk, dv, dg, db, dA_part, ddt_part, scr, wscr,
                            float(lower_bound), float(scale),
                            H=H, K=K, V=V, C=C, BK=BK, BV=BV, BKE=BKE, BKL=BKL, USE_L2=use_l2,
                            DT=DT, GP=GP, GPREC=GPREC, INV_PREC=CONFIG["bwd_inv_prec"],
                            num_warps=CONFIG["bwd_warps"])
    dA_log = dA_part.sum(0)
    ddt = ddt_part.sum(0)[:, :K].reshape(H * K)
    return dq, dk, dv, dg, db, dA_log, ddt, dh0


class KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu, lower_bound, scale,
                use_l2, output_final_state, seq_len):
        o, ht, saved = kda_fwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                               initial_state, cu, use_l2, output_final_state, seq_len)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, *saved)
        ctx.meta = (lower_bound, scale, initial_state is not None, use_l2)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, *saved = ctx.saved_tensors
        lower_bound, scale, has_h0, use_l2 = ctx.meta
        dq, dk, dv, dg, db, dA_log, ddt, dh0 = kda_bwd(
            q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, has_h0, use_l2, saved, do, dht)
        return dq, dk, dv, dg, db, dA_log, ddt, dh0, None, None, None, None, None, None


# Under torch.compile: the same kernels as custom ops (fake shapes: the chunk buffers' rows come from shapes).
@torch.library.custom_op("k3::kda", mutates_args=())
def _kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor], cu: torch.Tensor,
         lower_bound: float, scale: float, use_l2: bool, output_final_state: bool, seq_len: Optional[int]
         ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The Triton forward: (o, the final state or an empty tensor, the buffers for backward)."""
    o, ht, saved = kda_fwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, cu, use_l2,
                           output_final_state, seq_len, memo=False)
    return o, ht if ht is not None else q.new_empty(0, dtype=torch.float32), list(saved)


@_kda.register_fake
def _kda_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu, lower_bound, scale, use_l2, output_final_state,
              seq_len):
    B, T, H, K = q.shape
    V, N = v.shape[-1], cu.shape[0] - 1
    NC = chunk_capacity(B * T, N, seq_len)
    ht = q.new_empty((N, H, K, V) if output_final_state else (0,), dtype=torch.float32)
    i32 = torch.int32
    tables = [q.new_empty(NC, dtype=i32), q.new_empty(NC, dtype=i32), q.new_empty(N + 1, dtype=i32),
              q.new_empty(N + 1, dtype=i32)]  # chunk_seq, chunk_bos, chunk_off, cu
    return v.new_empty(B, T, H, V), ht, [*_chunk_buffers(q, v, NC), *tables]


@torch.library.custom_op("k3::kda_backward", mutates_args=())
def _kda_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, saved: list[torch.Tensor], do: torch.Tensor,
                  dht: Optional[torch.Tensor], lower_bound: float, scale: float, has_h0: bool, use_l2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v, g, beta, A_log, dt_bias and the initial state (empty without one)."""
    *grads, dh0 = kda_bwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, has_h0, use_l2, saved, do, dht)
    return *grads, dh0 if dh0 is not None else q.new_empty(0, dtype=torch.float32)


@_kda_backward.register_fake
def _kda_backward_fake(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, lower_bound, scale, has_h0, use_l2):
    N, (_, _, H, K), V = saved[-1].shape[0] - 1, q.shape, v.shape[-1]
    dh0 = q.new_empty((N, H, K, V) if has_h0 else (0,), dtype=torch.float32)
    return (*(torch.empty_like(t) for t in (q, k, v, g, beta)), A_log.new_empty(H), dt_bias.new_empty(H * K), dh0)


def _kda_setup(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, _, lower_bound, scale, use_l2, *_ = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, *output[2])
    ctx.meta = (lower_bound, scale, initial_state is not None, use_l2)


def _kda_grad(ctx, do, dht, _saved_grads):
    q, k, v, g, beta, A_log, dt_bias, *saved = ctx.saved_tensors
    lower_bound, scale, has_h0, use_l2 = ctx.meta
    dht = dht if dht is not None and dht.numel() else None
    *grads, dh0 = _kda_backward(q, k, v, g, beta, A_log, dt_bias, saved, do.contiguous(), dht, lower_bound,
                                scale, has_h0, use_l2)
    return *grads, dh0 if has_h0 else None, None, None, None, None, None, None


_kda.register_autograd(_kda_grad, setup_context=_kda_setup)


def _kda_compiled(q, k, v, g, beta, A_log, dt_bias, initial_state, cu, lower_bound, scale, use_l2,
                  output_final_state, seq_len):
    o, ht, _ = _kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu, lower_bound, scale, use_l2,
                    output_final_state, seq_len)
    return o, ht if output_final_state else None


_kda_call = eager_or_compiled(KDAFunction.apply, _kda_compiled)


def kda_triton(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
               initial_state=None, output_final_state=False, cu_seqlens=None,
               use_qk_l2norm=True, validate=True):
    """Triton KDA (same contract as kernels.kda.kda).  Works on CUDA tensors, and on CPU
    tensors under TRITON_INTERPRET=1 (tests).  Eagerly ``KDAFunction``; under ``torch.compile``
    one ``torch.library`` custom op (``k3::kda``, its backward ``k3::kda_backward``) with fake
    shapes, which inductor keeps inside its graphs.  Either way the chunk buffers are sized from
    shapes (``chunk_capacity``): no host sync, also for packed documents."""
    if validate:
        from . import validate_inputs
        validate_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                        cu_seqlens)
    B, T, H, K = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    cu = _offsets(cu_seqlens, B, T, q.device)
    seq_len = T if cu_seqlens is None else None
    return _kda_call(q, k, v, g, beta, A_log, dt_bias, initial_state, cu, float(lower_bound), float(scale),
                     bool(use_qk_l2norm), bool(output_final_state), seq_len)
