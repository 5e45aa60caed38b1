"""Triton kernel of ``reference.max_logit``: a program per (block of BM query rows, batch row × head).

The head dim D is cut into at most three power-of-two pieces of at least 16 (192 = 128 + 64), and the
block's queries are loaded once, piece by piece, before the key loop. The program walks the keys in
blocks of BN up to the block's largest row position (later keys are masked for every row in it); per
key block s = q kᵀ is one tensor-core dot per piece (fp32 accumulation; fp32 inputs exactly, "ieee",
as are bf16 ones under Triton's interpreter, whose dot does not take bf16), the disallowed pairs are
masked and the running maximum kept; the scale (> 0) is applied to the maximum, not to every logit.
Programs go last query block first (those see the most keys), so the short ones fill the tail. It
writes one partial maximum per program; the caller reduces them per head. No score tensor leaves the
program. With a head mask (``HEADS``, ``GATED``) the programs of unselected heads treat every row as
absent: no key block is read, the partial is −inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import feature_pieces

# (BM, BN, warps, stages) on the GPU: the fastest of eight at bench-1B's MLA shapes (8×4096 tokens, 8 heads,
# D = 192, bf16) on one H200, 0.64 ms against 0.76–1.27 for the others and 1.14 for the previous kernel
# (docs/results/max_logit_tiles_h200_2026-12-02.json); 190 registers, no spills (Triton 3.6, sm_90).
# The interpreter takes small tiles.
GPU_TILES = (128, 128, 4, 3)
INTERPRETER_TILES = (16, 16, 4, 1)


@triton.jit
def _load_q(q_base, rows, row_ok, sqt, d0: tl.constexpr, DP: tl.constexpr):
    d = d0 + tl.arange(0, DP)
    return tl.load(q_base + rows[:, None].to(tl.int64) * sqt + d[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _dot_piece(s, q, k_base, cols, col_ok, skt, d0: tl.constexpr, DP: tl.constexpr, FP32: tl.constexpr):
    d = d0 + tl.arange(0, DP)
    k = tl.load(k_base + cols[None, :].to(tl.int64) * skt + d[:, None], mask=col_ok[None, :], other=0.0)
    if FP32:
        return tl.dot(q.to(tl.float32), k.to(tl.float32), s, input_precision="ieee")
    return tl.dot(q, k, s)


@triton.jit
def _max_logit_kernel(Q, K, QDOC, KDOC, QPOS, HEADS, OUT, H, Tq, Tk,
                      sqb, sqh, sqt, skb, skh, skt, sdq, sdk, scale,
                      D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr, GATED: tl.constexpr):
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last query blocks have the most keys: first
    i_bh = tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    rows = i_m * BM + tl.arange(0, BM)
    rows_end = Tq
    if GATED:  # an unselected head: no row, so no key block either
        rows_end = tl.where(tl.load(HEADS + h).to(tl.int32) != 0, Tq, 0)
    row_ok = rows < rows_end
    pos = tl.load(QPOS + rows, mask=row_ok, other=-1).to(tl.int32)  # int32 masks: half the registers
    doc = tl.load(QDOC + b.to(tl.int64) * sdq + rows, mask=row_ok, other=-1).to(tl.int32)
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    q1 = _load_q(q_base, rows, row_ok, sqt, 0, D1)
    if D2 > 0:
        q2 = _load_q(q_base, rows, row_ok, sqt, D1, D2)
    if D3 > 0:
        q3 = _load_q(q_base, rows, row_ok, sqt, D1 + D2, D3)
    best = tl.full([BM], float("-inf"), dtype=tl.float32)
    key_end = tl.minimum(tl.max(pos, axis=0) + 1, Tk)
    for n0 in range(0, key_end, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < key_end
        s = _dot_piece(tl.zeros([BM, BN], dtype=tl.float32), q1, k_base, cols, col_ok, skt, 0, D1, FP32)
        if D2 > 0:
            s = _dot_piece(s, q2, k_base, cols, col_ok, skt, D1, D2, FP32)
        if D3 > 0:
            s = _dot_piece(s, q3, k_base, cols, col_ok, skt, D1 + D2, D3, FP32)
        kdoc = tl.load(KDOC + b.to(tl.int64) * sdk + cols, mask=col_ok, other=-2).to(tl.int32)
        ok = (cols[None, :] <= pos[:, None]) & (kdoc[None, :] == doc[:, None]) & row_ok[:, None]
        best = tl.maximum(best, tl.max(tl.where(ok, s, float("-inf")), axis=1))
    tl.store(OUT + i_bh.to(tl.int64) * tl.num_programs(0) + i_m, tl.max(best, axis=0) * scale)


def max_logit(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor,
              scale: float, heads: torch.Tensor | None = None, tiles=None) -> torch.Tensor:
    """q [B, H, Tq, D], k [B, H, Tk, D] (same dtype, last dim contiguous, ``feature_pieces(D)`` not None),
    q_doc [B, Tq], k_doc [B, Tk], q_pos [Tq] (integers, contiguous), scale > 0 → [H] fp32; ``heads`` [H]
    bool (contiguous) computes only those heads, −inf for the others. ``tiles``: (BM, BN, warps, stages),
    else the defaults."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    pieces = feature_pieces(D)
    if pieces is None:
        raise ValueError(f"the Triton max-logit kernel takes a head dim of at most three powers of two ≥ 16, got {D}")
    if not scale > 0:
        raise ValueError(f"the Triton max-logit kernel scales the maximum: scale must be > 0, got {scale}")
    interpreted = isinstance(_max_logit_kernel, InterpretedFunction)
    bm, bn, warps, stages = tiles or (INTERPRETER_TILES if interpreted else GPU_TILES)
    n_m = triton.cdiv(Tq, bm)
    partial = torch.empty(B * H, n_m, dtype=torch.float32, device=q.device)
    head_mask = q_pos if heads is None else heads.view(torch.uint8)  # not read unless GATED
    _max_logit_kernel[(n_m, B * H)](q, k, q_doc, k_doc, q_pos, head_mask, partial, H, Tq, Tk,
                                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                    q_doc.stride(0), k_doc.stride(0), float(scale),
                                    D1=pieces[0], D2=pieces[1], D3=pieces[2], BM=bm, BN=bn,
                                    FP32=interpreted or q.dtype == torch.float32, GATED=heads is not None,
                                    num_warps=warps, num_stages=stages)
    return partial.view(B, H, n_m).amax(dim=(0, 2))
