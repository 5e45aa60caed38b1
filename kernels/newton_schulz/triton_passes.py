"""Triton kernels of ``muon_passes.py``: elementwise over [nb, R, C] views with any strides.

A program owns one column stripe (BC columns) of one block and walks ROW_TILES tiles of BR rows
down it. Each tensor keeps its own strides, so a load from the parameter (contiguous along C) and
a store into a transposed stack view (contiguous along R) are both coalesced; Triton moves the
tile between the two layouts through shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BR, BC = 64, 64  # tile: BR rows x BC columns of one block
ROW_TILES = 4  # tiles a program walks down its column stripe


@triton.jit
def _tile(R, C, BR: tl.constexpr, BC: tl.constexpr, ROW_TILES: tl.constexpr):
    """(block, first row, columns) of this program."""
    pid = tl.program_id(0)
    stripes = tl.cdiv(C, BC)
    per_block = stripes * tl.cdiv(R, BR * ROW_TILES)
    rest = pid % per_block
    r0 = (rest // stripes) * (BR * ROW_TILES)
    cols = (rest % stripes) * BC + tl.arange(0, BC)
    return (pid // per_block).to(tl.int64), r0, cols


@triton.jit
def _nesterov_kernel(G, M, O, R, C, sgb, sgr, sgc, smb, smr, smc, sob, sor, soc, w, mu,
                     NESTEROV: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROW_TILES: tl.constexpr):
    blk, r0, cols = _tile(R, C, BR, BC, ROW_TILES)
    for t in tl.static_range(ROW_TILES):
        rows = r0 + t * BR + tl.arange(0, BR)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        g = tl.load(G + blk * sgb + rows[:, None] * sgr + cols[None, :] * sgc, mask=mask)
        g = g.to(M.dtype.element_ty)
        mptr = M + blk * smb + rows[:, None] * smr + cols[None, :] * smc
        m = tl.load(mptr, mask=mask)
        m = m + w * (g - m)
        tl.store(mptr, m, mask=mask)
        if NESTEROV:
            u = g + mu * (m - g)
        else:
            u = m
        tl.store(O + blk * sob + rows[:, None] * sor + cols[None, :] * soc, u.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _apply_kernel(P, U, S, R, C, spb, spr, spc, sub, sur, suc, beta, alpha, SCALARS_ON_DEVICE: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, ROW_TILES: tl.constexpr):
    if SCALARS_ON_DEVICE:  # beta and alpha point to fp32 scalars (a step captured in a CUDA graph)
        beta = tl.load(beta)
        alpha = tl.load(alpha)
    blk, r0, cols = _tile(R, C, BR, BC, ROW_TILES)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for t in tl.static_range(ROW_TILES):
        rows = r0 + t * BR + tl.arange(0, BR)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        u = tl.load(U + blk * sub + rows[:, None] * sur + cols[None, :] * suc, mask=mask, other=0.0)
        u = u.to(tl.float32)
        pptr = P + blk * spb + rows[:, None] * spr + cols[None, :] * spc
        p = tl.load(pptr, mask=mask).to(tl.float32)
        tl.store(pptr, (beta * p + alpha * u).to(P.dtype.element_ty), mask=mask)
        acc += u * u
    tl.atomic_add(S, tl.sum(tl.sum(acc, axis=1), axis=0))


def _grid(x: torch.Tensor) -> tuple[int]:
    nb, R, C = x.shape
    return (nb * triton.cdiv(C, BC) * triton.cdiv(R, BR * ROW_TILES),)


def nesterov_into(grad, buf, out, momentum: float, nesterov: bool) -> None:
    if buf.numel() == 0:
        return
    _nesterov_kernel[_grid(buf)](
        grad, buf, out, buf.shape[1], buf.shape[2], *grad.stride(), *buf.stride(), *out.stride(),
        1.0 - momentum, momentum, NESTEROV=bool(nesterov), BR=BR, BC=BC, ROW_TILES=ROW_TILES, num_warps=4,
    )


def apply_update(param, update, beta, alpha, sumsq) -> None:
    """beta and alpha: both Python numbers, or both one-element fp32 tensors on the parameter's device."""
    if param.numel() == 0:
        return
    if sumsq.dtype != torch.float32 or sumsq.numel() != 1:
        raise ValueError("apply_update: sumsq must be a one-element fp32 tensor")
    on_device = isinstance(beta, torch.Tensor)
    if on_device and not (isinstance(alpha, torch.Tensor) and beta.dtype == alpha.dtype == torch.float32
                          and beta.numel() == alpha.numel() == 1):
        raise ValueError("apply_update: beta and alpha must both be numbers or both one-element fp32 tensors")
    _apply_kernel[_grid(param)](
        param, update, sumsq, param.shape[1], param.shape[2], *param.stride(), *update.stride(),
        beta if on_device else float(beta), alpha if on_device else float(alpha), SCALARS_ON_DEVICE=on_device,
        BR=BR, BC=BC, ROW_TILES=ROW_TILES, num_warps=4,
    )
