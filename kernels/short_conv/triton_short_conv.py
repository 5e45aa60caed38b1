"""Triton causal short conv with document resets: one forward kernel, one backward kernel.

x, out, g are contiguous [B, T, C]; pos is [B, T]; math in ``reference.py``. Loads are cast to
fp32, all math is fp32, stores cast to the output's dtype.

* forward, w the fp32 weight as [C, W], any W: a[t] = Σ_s w_s · x[t−s] · [pos[t] ≥ s] · [t ≥ s];
  out = a, or a·σ(a) with ``SILU``. A program owns BLOCK_T rows × BLOCK_C channels of one batch
  row (grid: T blocks × C blocks × B) and reads W shifted [BLOCK_T, BLOCK_C] windows of one
  region, so each x row comes from HBM once and from cache for the other taps.
* backward, w left-padded with zero taps to [C, 4] (W ≤ 4, ``MAX_TAPS``):
  dx[t] = Σ_s w_s · ĝ[t+s] · [pos[t+s] ≥ s], and dw_s = Σ_t ĝ[t] · x[t−s] · [pos[t] ≥ s] with
  ĝ = g, or g · SiLU'(a) with ``SILU`` (a recomputed, not saved). A program walks ROWS rows of
  BLOCK_C channels one row at a time, keeping the last three x rows and the three unfinished dx
  rows in registers: each x and g row is read once (plus 3 halo rows a program) and there are no
  shifted tile windows to hold. Its part of dw goes to row ``program`` of a [programs, C, 4] fp32
  buffer, summed by the caller (deterministic, no atomics).

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import MAX_TAPS

# GPU tiles: forward BLOCK_T rows × BLOCK_C channels a program; backward ROWS rows × BLOCK_C channels.
# The interpreter takes small tiles so tests cover several row and channel blocks and their masked edges.
GPU_FWD, GPU_BWD = {"BLOCK_T": 64, "BLOCK_C": 128, "num_warps": 4}, {"ROWS": 32, "BLOCK_C": 128, "num_warps": 1}
INTERPRET_FWD, INTERPRET_BWD = {"BLOCK_T": 8, "BLOCK_C": 64}, {"ROWS": 8, "BLOCK_C": 64}


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
def _cols_if(cols, C, ok):
    """cols < C where the scalar ``ok`` holds, else all false: a row's column mask (one compare)."""
    return cols < C * ok.to(tl.int32)


@triton.jit
def _short_conv_bwd_kernel(X, W_, POS, G, DX, DWP, T, C, SILU: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """A program walks rows t0 … t0 + ROWS + 2 of one batch row, BLOCK_C channels, one row a step,
    holding x[t−1..t−3], the partial dx[t−1..t−3] and its dw_s sums in registers (4 taps; W_ is the
    weight left-padded with zero taps to [C, 4]). Step t: a[t] from the x window, ĝ[t], dw_s += ĝ[t] ·
    x[t−s] · m_s[t] (rows it owns), dx[t−s] += w_s · m_s[t] · ĝ[t]; dx[t−3] is then complete and
    stored if the program owns it. The 3 rows past its block are recomputed, not exchanged."""
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(0) * ROWS
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    X, G, DX, POS = X + b * T * C, G + b * T * C, DX + b * T * C, POS + b * T
    w0 = tl.load(W_ + cols * 4 + 3, mask=cmask, other=0.0)
    w1 = tl.load(W_ + cols * 4 + 2, mask=cmask, other=0.0)
    w2 = tl.load(W_ + cols * 4 + 1, mask=cmask, other=0.0)
    w3 = tl.load(W_ + cols * 4, mask=cmask, other=0.0)
    x1 = tl.load(X + (t0 - 1).to(tl.int64) * C + cols, mask=_cols_if(cols, C, t0 >= 1), other=0.0).to(tl.float32)
    x2 = tl.load(X + (t0 - 2).to(tl.int64) * C + cols, mask=_cols_if(cols, C, t0 >= 2), other=0.0).to(tl.float32)
    x3 = tl.load(X + (t0 - 3).to(tl.int64) * C + cols, mask=_cols_if(cols, C, t0 >= 3), other=0.0).to(tl.float32)
    d1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    d2, d3 = d1, d1
    dw0, dw1, dw2, dw3 = d1, d1, d1, d1
    for t in range(t0, t0 + ROWS + 3):
        live, row = t < T, tl.cast(t, tl.int64) * C
        xt = tl.load(X + row + cols, mask=_cols_if(cols, C, live), other=0.0).to(tl.float32)
        g = tl.load(G + row + cols, mask=_cols_if(cols, C, live), other=0.0).to(tl.float32)
        p = tl.where(live, tl.load(POS + tl.minimum(t, T - 1)), 0)
        m1, m2, m3 = (p >= 1).to(tl.float32), (p >= 2).to(tl.float32), (p >= 3).to(tl.float32)
        if SILU:
            g = g * _dsilu(w0 * xt + m1 * w1 * x1 + m2 * w2 * x2 + m3 * w3 * x3)  # ĝ[t]
        own = (t < t0 + ROWS).to(tl.float32)
        dw0 += own * g * xt
        dw1 += own * m1 * g * x1
        dw2 += own * m2 * g * x2
        dw3 += own * m3 * g * x3
        done = d3 + m3 * w3 * g  # dx[t−3]
        tl.store(DX + row - 3 * C + cols, done.to(DX.dtype.element_ty), mask=_cols_if(cols, C, (t - 3 >= t0) & (t - 3 < T)))
        d3, d2, d1 = d2 + m2 * w2 * g, d1 + m1 * w1 * g, w0 * g
        x3, x2, x1 = x2, x1, xt
    part = DWP + ((b * tl.num_programs(0) + tl.program_id(0)) * C + cols) * 4
    tl.store(part + 3, dw0, mask=cmask)
    tl.store(part + 2, dw1, mask=cmask)
    tl.store(part + 1, dw2, mask=cmask)
    tl.store(part, dw3, mask=cmask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_short_conv_fwd_kernel, InterpretedFunction)


def _tiles(t: torch.Tensor, gpu: dict, interpreted: dict) -> dict:
    """The tile meta-parameters for tensor ``t``'s device."""
    if t.is_cuda:
        return gpu
    if interpreter_active():
        return interpreted
    raise RuntimeError("the Triton short-conv kernels got a CPU tensor, but Triton's interpreter "
                       "is off: set TRITON_INTERPRET=1 before triton is imported, or use "
                       "backend='torch'")


def short_conv_fwd(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """x: contiguous [B, T, C]; w: contiguous fp32 [C, W]; pos: contiguous [B, T] → out [B, T, C]
    in x's dtype (SiLU of the conv with ``silu``)."""
    B, T, C = x.shape
    out = torch.empty_like(x)
    if out.numel():
        meta = _tiles(x, GPU_FWD, INTERPRET_FWD)
        grid = (triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(C, meta["BLOCK_C"]), B)
        _short_conv_fwd_kernel[grid](x, w, pos, out, T, C, W=w.shape[1], SILU=silu, **meta)
    return out


def short_conv_bwd(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, grad_out: torch.Tensor,
                   silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``short_conv_fwd``'s out: (dx [B, T, C] in x's dtype, dw [C, W] fp32), W ≤
    ``MAX_TAPS``; grad_out is a contiguous [B, T, C]."""
    B, T, C = x.shape
    W = w.shape[1]
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx, torch.zeros_like(w)
    meta = _tiles(x, GPU_BWD, INTERPRET_BWD)
    grid = (triton.cdiv(T, meta["ROWS"]), triton.cdiv(C, meta["BLOCK_C"]), B)
    pad = MAX_TAPS - W  # zero taps s ≥ W
    w4 = torch.nn.functional.pad(w, (pad, 0)) if pad else w
    dw_parts = torch.empty((grid[0] * B, C, MAX_TAPS), dtype=torch.float32, device=x.device)
    _short_conv_bwd_kernel[grid](x, w4, pos, grad_out, dx, dw_parts, T, C, SILU=silu, **meta)
    return dx, dw_parts.sum(0)[:, pad:].contiguous()  # (a no-op slice and contiguous() for W = 4)
