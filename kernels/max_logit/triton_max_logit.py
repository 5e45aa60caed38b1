"""Triton kernel of ``reference.max_logit``: a program per (block of BM query rows, batch row × head).

It loads the block's row positions and document ids, walks the keys in blocks of BN up to the block's
largest row position (later keys are masked for every row in it), and per key block accumulates
s = q kᵀ over D in chunks of BD on the tensor cores (fp32 accumulation; fp32 inputs exactly, "ieee",
as are bf16 ones under Triton's interpreter, whose dot does not take bf16),
masks the disallowed pairs and keeps the running maximum. It writes one partial maximum per program;
the caller reduces them per head. No score tensor leaves the program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _max_logit_kernel(Q, K, QDOC, KDOC, QPOS, OUT, H, Tq, Tk, D,
                      sqb, sqh, sqt, skb, skh, skt, sdq, sdk, scale,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, FP32: tl.constexpr):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    rows = i_m * BM + tl.arange(0, BM)
    row_ok = rows < Tq
    pos = tl.load(QPOS + rows, mask=row_ok, other=-1).to(tl.int32)  # int32 masks: half the registers
    doc = tl.load(QDOC + b.to(tl.int64) * sdq + rows, mask=row_ok, other=-1).to(tl.int32)
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    dd = tl.arange(0, BD)
    best = tl.full([BM], float("-inf"), dtype=tl.float32)
    key_end = tl.minimum(tl.max(pos, axis=0) + 1, Tk)
    for n0 in range(0, key_end, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < key_end
        s = tl.zeros([BM, BN], dtype=tl.float32)
        for d0 in range(0, D, BD):
            qd = tl.load(q_base + rows[:, None].to(tl.int64) * sqt + (d0 + dd)[None, :], mask=row_ok[:, None], other=0.0)
            kd = tl.load(k_base + cols[None, :].to(tl.int64) * skt + (d0 + dd)[:, None], mask=col_ok[None, :], other=0.0)
            if FP32:
                s += tl.dot(qd.to(tl.float32), kd.to(tl.float32), input_precision="ieee")
            else:
                s += tl.dot(qd, kd)
        kdoc = tl.load(KDOC + b.to(tl.int64) * sdk + cols, mask=col_ok, other=-2).to(tl.int32)
        ok = (cols[None, :] <= pos[:, None]) & (kdoc[None, :] == doc[:, None]) & col_ok[None, :] & row_ok[:, None]
        best = tl.maximum(best, tl.max(tl.where(ok, s * scale, float("-inf")), axis=1))
    tl.store(OUT + i_bh.to(tl.int64) * tl.num_programs(0) + i_m, tl.max(best, axis=0))


def _feature_chunk(d: int) -> int:
    """The largest power of two ≤ 64 dividing D (≥ 16: a tensor-core dot's smallest K)."""
    bd = 64
    while d % bd:
        bd //= 2
    if bd < 16:
        raise ValueError(f"the Triton max-logit kernel needs a head dim divisible by 16, got {d}")
    return bd


def max_logit(q: torch.Tensor, k: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [B, H, Tq, D], k [B, H, Tk, D] (same dtype, last dim contiguous), q_doc [B, Tq], k_doc [B, Tk],
    q_pos [Tq] (integers, contiguous) → [H] fp32."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    interpreted = isinstance(_max_logit_kernel, InterpretedFunction)
    # 128 × 64 tiles, 8 warps: an offline sm_90 compile (Triton 3.9) holds them in 224 registers without
    # spills; 64 × 64 with 4 warps spilled 80 B a thread (not yet timed on a GPU)
    bm, bn = (16, 16) if interpreted else (128, 64)
    n_m = triton.cdiv(Tq, bm)
    partial = torch.empty(B * H, n_m, dtype=torch.float32, device=q.device)
    _max_logit_kernel[(n_m, B * H)](q, k, q_doc, k_doc, q_pos, partial, H, Tq, Tk, D,
                                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                    q_doc.stride(0), k_doc.stride(0), float(scale),
                                    BM=bm, BN=bn, BD=_feature_chunk(D), FP32=interpreted or q.dtype == torch.float32,
                                    num_warps=8)
    return partial.view(B, H, n_m).amax(dim=(0, 2))
