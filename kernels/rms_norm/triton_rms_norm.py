"""Triton RMSNorm: one forward kernel, one backward kernel (math in ``reference.py``).

Both take [M, n] row views (last dim contiguous, n ≤ ``MAX_N``); a program holds
[BLOCK_M, BLOCK_N ≥ n] tiles, loads cast to fp32, math in fp32, stores cast to the
output's dtype.

* forward: one tile of rows a program; writes y and r [M] (fp32, saved for the backward). With
  gate logits G [M, n] (``HAS_GATE``), y = (x·r)·w·σ(g), and the backward also writes dg.
* backward: a fixed number P of programs (a few per SM), each walking its own contiguous run
  of rows: writes dx, and its partial Σ dy⊙x̂ [n] in fp32 to row p of a [P, n] buffer that the
  caller sums over P. No atomics: the result does not depend on scheduling.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported); it truncates fp32 → bf16 stores where GPUs round to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..row_tiles import RowTiles, row_tiles

MAX_N = 16384
# elements of one [BLOCK_M, BLOCK_N] tile: fastest or within 5% in a CUDA-graph-timed sweep of 2048-16384 at
# 32k tokens over bench-1B's four norm shapes (one H200; fwd+bwd 0.146 vs 0.191 ms at [32768, 1024] for 8192)
GPU_BLOCK_ELEMS = 2048
GPU_PROGRAMS_PER_SM = 4
INTERPRET_PROGRAMS = 3


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _rms_norm_fwd_kernel(X, W, G, Y, R, M, N, stride_x, stride_g, stride_y, eps,
                         HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (x * r[:, None]) * w[None, :]
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * _sigmoid(g)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(R + rows, r, mask=rows < M)


@triton.jit
def _rms_norm_bwd_kernel(X, W, G, DY, R, DX, DG, DW_PARTIAL, M, N, stride_x, stride_g, stride_dy, stride_dx,
                         stride_dg, rows_per_program,
                         HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + rows, mask=row_ok, other=0.0)
        xhat = x * r[:, None]
        if HAS_GATE:
            g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sg = _sigmoid(g)
            dg = dy * (xhat * w[None, :]) * sg * (1.0 - sg)
            tl.store(DG + rows[:, None] * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
            dy = dy * sg
        wdy = w[None, :] * dy
        c = tl.sum(xhat * wdy, axis=1) / N
        dx = (wdy - xhat * c[:, None]) * r[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_ok)


def _interpreted() -> bool:
    return isinstance(_rms_norm_fwd_kernel, InterpretedFunction)


def _tiles(n: int) -> RowTiles:
    return row_tiles(n, MAX_N, GPU_BLOCK_ELEMS, _interpreted(), "the Triton RMSNorm's row length")


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, n] (last dim contiguous), weight [n], gate logits [M, n] or None → y [M, n] in out_dtype,
    r [M] fp32."""
    M, n = x.shape
    y = torch.empty(M, n, dtype=out_dtype, device=x.device)
    r = torch.empty(M, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = _tiles(n)
    g = x if gate is None else gate  # any pointer when there is no gate
    _rms_norm_fwd_kernel[(triton.cdiv(M, block_m),)](x, weight, g, y, r, M, n, x.stride(0), g.stride(0), y.stride(0),
                                                     eps, HAS_GATE=gate is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                                     num_warps=warps)
    return y, r


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, r: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x, dy [M, n] (dy in any float dtype), weight [n], gate [M, n] or None, r [M] → dx [M, n] in x.dtype,
    dw [n] in weight.dtype, dgate [M, n] in gate.dtype (None without a gate)."""
    M, n = x.shape
    block_m, block_n, warps = _tiles(n)
    if _interpreted():
        programs = INTERPRET_PROGRAMS
    else:
        programs = GPU_PROGRAMS_PER_SM * torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = max(1, min(programs, triton.cdiv(M, block_m)))
    rows_per_program = triton.cdiv(triton.cdiv(M, programs), block_m) * block_m
    programs = triton.cdiv(M, rows_per_program) if M else 1
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgate = None if gate is None else torch.empty(M, n, dtype=gate.dtype, device=x.device)
    g, dg = (x, dx) if gate is None else (gate, dgate)  # any pointers when there is no gate
    partial = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x, weight, g, dy, r, dx, dg, partial, M, n, x.stride(0), g.stride(0),
                                      dy.stride(0), dx.stride(0), dg.stride(0), rows_per_program,
                                      HAS_GATE=gate is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                      num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype), dgate
