"""Triton causal short conv with document resets: one forward kernel, one backward kernel.

x, out, g are contiguous [B, T, C]; w is the fp32 weight as [C, W]; pos is [B, T]. A program owns
BLOCK_T rows × BLOCK_C channels of one batch row (grid: T blocks × C blocks × B) and reads the
W shifted [BLOCK_T, BLOCK_C] windows of one [BLOCK_T + W − 1, BLOCK_C] region, so each x row
comes from HBM once and from cache for the other taps (math in ``reference.py``):

* forward: a[t] = Σ_s w_s · x[t−s] · [pos[t] ≥ s] · [t ≥ s]; out = a, or a·σ(a) with ``SILU``;
* backward: dx[t] = Σ_s w_s · ĝ[t+s] · [pos[t+s] ≥ s] (windows of g reaching W − 1 rows past
  the block), and this program's part of dw_s = Σ_t ĝ[t] · x[t−s] · [pos[t] ≥ s] into row
  ``program`` of a [programs, C, W] fp32 buffer, summed by the caller (deterministic, no atomics);
  ĝ = g, or with ``SILU`` g · SiLU'(a), a recomputed from x for each shifted window (W more taps
  each, from cache) instead of saving it.

Loads are cast to fp32, all math is fp32, stores cast to the output's dtype. On CPU the kernels
run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# GPU tiles (untuned): BLOCK_T rows × BLOCK_C channels a program; the interpreter takes small tiles
# so tests cover several row and channel blocks and their masked edges.
GPU_BLOCKS, GPU_NUM_WARPS = (64, 128), 4
INTERPRET_BLOCKS = (8, 64)


@triton.jit
def _tap(X, POS, row0, r, cols, cmask, T, C, s: tl.constexpr, delay: tl.constexpr):
    """X[row0 + r − delay, cols] as fp32 [BLOCK_T, BLOCK_C], zero where tap s is masked at row r
    (r ≥ T, r < s, pos[r] < s) or the column is past C."""
    ok = (r < T) & (r >= s)
    if s > 0:
        ok = ok & (tl.load(POS + row0 + r, mask=r < T, other=0) >= s)
    offs = (row0 + r - delay)[:, None] * C + cols[None, :]
    return tl.load(X + offs, mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_rows(X, W_, POS, row0, r, cols, cmask, T, C, W: tl.constexpr):
    """a[r] = Σ_s w_s · x[r−s] · m_s[r] as fp32 [BLOCK_T, BLOCK_C] for rows r (zero past T)."""
    acc = tl.zeros([r.shape[0], cols.shape[0]], dtype=tl.float32)
    for s in tl.static_range(W):
        w = tl.load(W_ + cols * W + (W - 1 - s), mask=cmask, other=0.0)
        acc += w[None, :] * _tap(X, POS, row0, r, cols, cmask, T, C, s, s)  # x[r−s]·m_s[r]
    return acc


@triton.jit
def _dsilu(a):
    """SiLU'(a) = σ(a)·(1 + a·(1 − σ(a)))."""
    sig = 1.0 / (1.0 + tl.exp(-a))
    return sig * (1.0 + a * (1.0 - sig))


@triton.jit
def _short_conv_fwd_kernel(X, W_, POS, O, T, C, W: tl.constexpr, SILU: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    row0 = tl.program_id(2).to(tl.int64) * T
    acc = _conv_rows(X, W_, POS, row0, t, cols, cmask, T, C, W)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    offs = (row0 + t)[:, None] * C + cols[None, :]
    tl.store(O + offs, acc.to(O.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _short_conv_bwd_kernel(X, W_, POS, G, DX, DWP, T, C, W: tl.constexpr, SILU: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    row0 = tl.program_id(2).to(tl.int64) * T
    program = tl.program_id(2).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    offs = (row0 + t)[:, None] * C + cols[None, :]
    g = tl.load(G + offs, mask=(t < T)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if SILU:
        g = g * _dsilu(_conv_rows(X, W_, POS, row0, t, cols, cmask, T, C, W))  # ĝ[t]
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for s in tl.static_range(W):
        w = tl.load(W_ + cols * W + (W - 1 - s), mask=cmask, other=0.0)
        gs = _tap(G, POS, row0, t + s, cols, cmask, T, C, s, 0)  # g[t+s]·m_s[t+s]
        if SILU:
            gs = gs * _dsilu(_conv_rows(X, W_, POS, row0, t + s, cols, cmask, T, C, W))  # ĝ[t+s]·m_s[t+s]
        dx += w[None, :] * gs
        dw = tl.sum(g * _tap(X, POS, row0, t, cols, cmask, T, C, s, s), axis=0)  # ĝ[t]·x[t−s]·m_s[t]
        tl.store(DWP + (program * C + cols) * W + (W - 1 - s), dw, mask=cmask)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_short_conv_fwd_kernel, InterpretedFunction)


def _launch(B: int, T: int, C: int, W: int, silu: bool, t: torch.Tensor) -> tuple[tuple[int, int, int], dict]:
    """(grid, meta-parameters) for x [B, T, C], W taps and the SiLU flag."""
    if t.is_cuda:
        (bt, bc), opts = GPU_BLOCKS, {"num_warps": GPU_NUM_WARPS}
    elif interpreter_active():
        (bt, bc), opts = INTERPRET_BLOCKS, {}
    else:
        raise RuntimeError("the Triton short-conv kernels got a CPU tensor, but Triton's interpreter "
                           "is off: set TRITON_INTERPRET=1 before triton is imported, or use "
                           "backend='torch'")
    return (triton.cdiv(T, bt), triton.cdiv(C, bc), B), {"W": W, "SILU": silu, "BLOCK_T": bt, "BLOCK_C": bc,
                                                          **opts}


def short_conv_fwd(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """x: contiguous [B, T, C]; w: contiguous fp32 [C, W]; pos: contiguous [B, T] → out [B, T, C]
    in x's dtype (SiLU of the conv with ``silu``)."""
    B, T, C = x.shape
    out = torch.empty_like(x)
    if out.numel():
        grid, meta = _launch(B, T, C, w.shape[1], silu, x)
        _short_conv_fwd_kernel[grid](x, w, pos, out, T, C, **meta)
    return out


def short_conv_bwd(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, grad_out: torch.Tensor,
                   silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``short_conv_fwd``'s out: (dx [B, T, C] in x's dtype, dw [C, W] fp32);
    grad_out is a contiguous [B, T, C]."""
    B, T, C = x.shape
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx, torch.zeros_like(w)
    grid, meta = _launch(B, T, C, w.shape[1], silu, x)
    dw_parts = torch.empty((grid[0] * grid[2], C, w.shape[1]), dtype=torch.float32, device=x.device)
    _short_conv_bwd_kernel[grid](x, w, pos, grad_out, dx, dw_parts, T, C, **meta)
    return dx, dw_parts.sum(0)
