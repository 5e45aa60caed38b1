"""Triton Block AttnRes aggregation: one forward kernel and one backward kernel.

The S ≤ MAX_SOURCES sources are separate [M, d] tensors (row-major, M tokens) passed as separate
pointer arguments V0..V7 with a constexpr S (unused slots repeat V0 and are never read); nothing
is stacked. A program owns BLOCK_M tokens and walks d in chunks of BLOCK_D twice:

* forward: pass 1 reads every source once and accumulates Σ v_i² and q̃ · v_i per token, giving
  r_i, l_i = r_i q̃ · v_i and a = softmax(l) ([BLOCK_M, S_PAD] tiles, S_PAD = next power of two);
  pass 2 re-reads the same rows (just read by this program, so mostly from cache) and writes
  out = Σ a_i v_i. Saved for the backward: r and a as [M, S] fp32 (8·S bytes a token).
* backward: pass 1 reads g and every v_i once for c_i = g · v_i and p_i = q̃ · v_i, forming
  dl_i = a_i (c_i − Σ_j a_j c_j); pass 2 re-reads them and writes
  dv_i = a_i g + dl_i r_i q̃ − dl_i (r_i³/d) p_i v_i, and this program's part of
  dq̃ = Σ_tokens Σ_i dl_i r_i v_i into row ``pid`` of a [programs, d] fp32 buffer (summed by the
  caller: deterministic, no atomics).

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
# by the benchmark's sweep) replaces both. The interpreter takes small tiles so tests cover several row
# blocks, several d chunks and the masked edges.
GPU_FWD_TILE = (2, 4)
GPU_BWD_TILE_FEW, GPU_BWD_TILE_MANY, GPU_BWD_FEW_SOURCES = (8, 4), (2, 4), 3
GPU_MAX_BLOCK_D = 512
GPU_TILE_OVERRIDE: tuple[int, int] | None = None
INTERPRET_BLOCKS = (4, 64)


def gpu_tile(S: int, backward: bool) -> tuple[int, int]:
    """(BLOCK_M, num_warps) of the forward or backward kernel for S sources on a GPU."""
    if GPU_TILE_OVERRIDE is not None:
        return GPU_TILE_OVERRIDE
    if not backward:
        return GPU_FWD_TILE
    return GPU_BWD_TILE_FEW if S <= GPU_BWD_FEW_SOURCES else GPU_BWD_TILE_MANY


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
def _attn_res_fwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, Q, O, R, A, M, D, eps,
                         S: tl.constexpr, S_PAD: tl.constexpr,
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
            v = tl.load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7) + rows2 * D + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            sumsq += tl.where(scol == i, tl.sum(v * v, axis=1)[:, None], 0.0)
            qdot += tl.where(scol == i, tl.sum(v * q, axis=1)[:, None], 0.0)
    r = 1.0 / tl.sqrt(sumsq / D + eps)
    logits = tl.where(scol < S, r * qdot, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    a = e / tl.sum(e, axis=1)[:, None]
    smask = ok2 & (scol < S)
    tl.store(R + rows2 * S + scol, r, mask=smask)
    tl.store(A + rows2 * S + scol, a, mask=smask)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = ok2 & (cols[None, :] < D)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7) + rows2 * D + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            acc += _column(a, scol, i)[:, None] * v
        tl.store(O + rows2 * D + cols[None, :], acc.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _attn_res_bwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7,
                         Q, G, R, A, DQ, M, D,
                         S: tl.constexpr, S_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows2, ok2 = rows[:, None], row_ok[:, None]
    scol = tl.arange(0, S_PAD)[None, :]
    smask = ok2 & (scol < S)
    r = tl.load(R + rows2 * S + scol, mask=smask, other=0.0)
    a = tl.load(A + rows2 * S + scol, mask=smask, other=0.0)
    gdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)
    qdot = tl.zeros([BLOCK_M, S_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = ok2 & (cols[None, :] < D)
        q = tl.load(Q + cols, mask=cols < D, other=0.0)[None, :]
        g = tl.load(G + rows2 * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(S):
            v = tl.load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7) + rows2 * D + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            gdot += tl.where(scol == i, tl.sum(v * g, axis=1)[:, None], 0.0)
            qdot += tl.where(scol == i, tl.sum(v * q, axis=1)[:, None], 0.0)
    dl = a * (gdot - tl.sum(a * gdot, axis=1)[:, None])
    coef_q = dl * r  # dv_i = a_i g + coef_q_i q̃ − coef_v_i v_i;  dq̃ += coef_q_i v_i
    coef_v = coef_q * r * r * qdot / D
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = ok2 & cmask[None, :]
        offs = rows2 * D + cols[None, :]
        q = tl.load(Q + cols, mask=cmask, other=0.0)[None, :]
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        dq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(_pick(i, V0, V1, V2, V3, V4, V5, V6, V7) + offs, mask=mask,
                        other=0.0).to(tl.float32)
            cq = _column(coef_q, scol, i)[:, None]
            dv = _column(a, scol, i)[:, None] * g + cq * q - _column(coef_v, scol, i)[:, None] * v
            DVi = _pick(i, DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7)
            tl.store(DVi + offs, dv.to(DVi.dtype.element_ty), mask=mask)
            dq += tl.sum(cq * v, axis=0)
        tl.store(DQ + pid.to(tl.int64) * D + cols, dq, mask=cmask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_attn_res_fwd_kernel, InterpretedFunction)


def _launch(M: int, D: int, S: int, t: torch.Tensor, backward: bool) -> tuple[int, dict]:
    """(number of programs, meta-parameters) for M tokens of d = D features and S sources."""
    if S < 1 or S > MAX_SOURCES:
        raise ValueError(f"the Triton AttnRes kernels take 1..{MAX_SOURCES} sources, got {S}")
    if t.is_cuda:
        bm, warps = gpu_tile(S, backward)
        bd = min(GPU_MAX_BLOCK_D, max(16, triton.next_power_of_2(D)))
        opts = {"num_warps": warps}
    elif interpreter_active():
        (bm, bd), opts = INTERPRET_BLOCKS, {}
    else:
        raise RuntimeError("the Triton AttnRes kernels got a CPU tensor, but Triton's interpreter is "
                           "off: set TRITON_INTERPRET=1 before triton is imported, or use "
                           "backend='torch'")
    meta = {"S": S, "S_PAD": max(2, triton.next_power_of_2(S)), "BLOCK_M": bm, "BLOCK_D": bd, **opts}
    return triton.cdiv(M, bm), meta


def _slots(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ts`` padded to MAX_SOURCES pointer arguments with ts[0] (never read past S)."""
    return list(ts) + [ts[0]] * (MAX_SOURCES - len(ts))


def attn_res_fwd(sources: list[torch.Tensor], qt: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sources: S contiguous [M, d] tensors of one dtype; qt: contiguous fp32 [d] (w ⊙ γ)
    → (out [M, d] in the sources' dtype, r [M, S] fp32, a [M, S] fp32)."""
    M, D = sources[0].shape
    S, dev = len(sources), sources[0].device
    out = torch.empty((M, D), dtype=sources[0].dtype, device=dev)
    r = torch.empty((M, S), dtype=torch.float32, device=dev)
    a = torch.empty((M, S), dtype=torch.float32, device=dev)
    if M * D:
        n, meta = _launch(M, D, S, sources[0], backward=False)
        _attn_res_fwd_kernel[(n,)](*_slots(sources), qt, out, r, a, M, D, RMS_EPS, **meta)
    return out, r, a


def attn_res_bwd(sources: list[torch.Tensor], qt: torch.Tensor, grad_out: torch.Tensor,
                 r: torch.Tensor, a: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradients of ``attn_res_fwd``'s out: (dv_i [M, d] in the sources' dtype, dq̃ [d] fp32);
    grad_out is a contiguous [M, d]."""
    M, D = sources[0].shape
    dvs = [torch.empty_like(v) for v in sources]
    if M * D == 0:
        return dvs, torch.zeros(D, dtype=torch.float32, device=qt.device)
    n, meta = _launch(M, D, len(sources), sources[0], backward=True)
    dq_parts = torch.empty((n, D), dtype=torch.float32, device=qt.device)
    _attn_res_bwd_kernel[(n,)](*_slots(sources), *_slots(dvs), qt, grad_out, r, a, dq_parts, M, D,
                               **meta)
    return dvs, dq_parts.sum(0)
