"""Triton MoE token permutation: dispatch and combine, each one launch forward and one backward (in the padded
layout, dispatch's forward and combine's backward also zero the padding rows, in programs of the same launch).

Every kernel runs one program per block of BLOCK_T tokens and loops over ℓ in BLOCK_L columns.
A program reads its tokens' k grouped-row indices r[i, j] = inverse[i·k + j] (a [BLOCK_T, KP]
tile, KP = k rounded up to a power of two, masked) and moves [BLOCK_T, KP, BLOCK_L] tiles of
grouped rows. Only ``inverse`` is used: each grouped row belongs to exactly one (i, j), so the
scatters below write every row once and nothing needs atomics::

    dispatch fwd:  x[r[i, j]] = z[i]                        (z read once, written k times)
                   xw[r[i, j]] = w[i, j]                    (optional: the copies' gate weights as rows)
    dispatch bwd:  dz[i] = Σ_j dx[r[i, j]]                  (gather, fp32 sum)
                   dw[i, j] = dxw[r[i, j]]                  (optional, with xw)
    combine fwd:   u[i] = Σ_j w[i, j] · y[r[i, j]]          (gather, fp32 sum)
    combine bwd:   dy[r[i, j]] = w[i, j] · du[i],  dw[i, j] = Σ_ℓ y[r[i, j]] · du[i]   (fp32)

Row tensors are 2-D with a contiguous last dim and free row strides; ``inverse`` and the
weights are contiguous. Row offsets are int64 (N·k·ℓ may pass 2^31); int32 or int64 indices.
Loads are cast to fp32 and stores to the output's dtype. On CPU the kernels run through Triton's
interpreter (``TRITON_INTERPRET=1`` before triton is imported), which truncates fp32 → bf16
stores; GPUs round to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# GPU tiles: about GPU_TILE_ELEMS elements of [BLOCK_T, KP, BLOCK_L] a program. Swept with
# benchmarks/moe_components.py --permute-tiles (E=128, k=8, ℓ=512, 16384 tokens, bf16, one H200, CUDA-graph
# replays; docs/results/moe_components_tiles_h200_2026-12-01.json): 8192 × 4 warps (2 tokens a program at
# ℓ = 512) takes the gather fwd+bwd from 0.135 to 0.084 ms and the combine from 0.189 to 0.121 ms against
# 4096 × 4; 16384 and 32768 are no better. The interpreter takes small tiles so that tests cover several
# token and column blocks and the masked edges. Each kernel alone over 24 tiles (elements 4096-32768 × 2-8 warps ×
# BLOCK_L 256/512; docs/results/moe_permute_plan_sweep_s36_h200_2026-12-03.json): these take the four in 169.0 us,
# the best single tile 167.3 and each kernel's best 165.4, i.e. at HBM speed (a 134 MB zero_ takes ~40 us).
GPU_TILE_ELEMS = 8192
GPU_MAX_BLOCK_L = 512
GPU_NUM_WARPS = 4
INTERPRET_BLOCKS = (4, 16)  # (BLOCK_T, BLOCK_L)


@triton.jit
def _copies(INV, N, TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's tokens t [BLOCK_T] (int64), their grouped rows r [BLOCK_T, KP] (int64),
    the token mask [BLOCK_T] and the copy mask [BLOCK_T, KP]."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, KP)
    tmask = t < N
    cmask = tmask[:, None] & (j[None, :] < TOP_K)
    r = tl.load(INV + t[:, None] * TOP_K + j[None, :], mask=cmask, other=0).to(tl.int64)
    return t, r, tmask, cmask


@triton.jit
def _pad_tile(PAD_ROWS, P, q, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Padding program q's rows r [BLOCK_T, KP] (int64): its BLOCK_T·KP entries p of the P listed rows (the tile of
    a program's copies), and their mask p < P."""
    p = q.to(tl.int64) * (BLOCK_T * KP) + tl.arange(0, BLOCK_T)[:, None] * KP + tl.arange(0, KP)[None, :]
    return tl.load(PAD_ROWS + p, mask=p < P, other=0).to(tl.int64), p < P


@triton.jit
def _zero_pad_rows(X, PAD_ROWS, P, L, stride_x, q, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """x[pad_rows[p]] = 0 for padding program q's rows (``_pad_tile``)."""
    r, pmask = _pad_tile(PAD_ROWS, P, q, KP, BLOCK_T)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        zeros = tl.zeros((BLOCK_T, KP, BLOCK_L), dtype=X.dtype.element_ty)
        tl.store(X + r[:, :, None] * stride_x + cols[None, None, :], zeros,
                 mask=pmask[:, :, None] & (cols < L)[None, None, :])


@triton.jit
def _dispatch_fwd_kernel(Z, W, INV, X, XW, PAD_ROWS, N, P, L, stride_z, stride_x, TOP_K: tl.constexpr,
                         KP: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """Programs [0, ⌈N / BLOCK_T⌉) copy tokens (and with HAS_W their copies' weights, xw[r[i, j]] = w[i, j]); the
    rest zero the P padding rows ``PAD_ROWS`` (of xw too)."""
    token_programs = tl.cdiv(N, BLOCK_T)
    if tl.program_id(0) >= token_programs:
        q = tl.program_id(0) - token_programs
        _zero_pad_rows(X, PAD_ROWS, P, L, stride_x, q, KP, BLOCK_T, BLOCK_L)
        if HAS_W:
            r, pmask = _pad_tile(PAD_ROWS, P, q, KP, BLOCK_T)
            tl.store(XW + r, tl.zeros((BLOCK_T, KP), dtype=XW.dtype.element_ty), mask=pmask)
        return
    t, r, tmask, cmask = _copies(INV, N, TOP_K, KP, BLOCK_T)
    if HAS_W:
        tl.store(XW + r, tl.load(W + t[:, None] * TOP_K + tl.arange(0, KP)[None, :], mask=cmask), mask=cmask)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        z = tl.load(Z + t[:, None] * stride_z + cols[None, :], mask=tmask[:, None] & cm[None, :])
        z3 = tl.broadcast_to(z[:, None, :], (BLOCK_T, KP, BLOCK_L))
        tl.store(X + r[:, :, None] * stride_x + cols[None, None, :], z3,
                 mask=cmask[:, :, None] & cm[None, None, :])


@triton.jit
def _dispatch_bwd_kernel(DX, DXW, INV, DZ, DW, N, L, stride_dx, stride_dz, TOP_K: tl.constexpr,
                         KP: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    t, r, tmask, cmask = _copies(INV, N, TOP_K, KP, BLOCK_T)
    if HAS_W:
        tl.store(DW + t[:, None] * TOP_K + tl.arange(0, KP)[None, :],
                 tl.load(DXW + r, mask=cmask).to(DW.dtype.element_ty), mask=cmask)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        dx = tl.load(DX + r[:, :, None] * stride_dx + cols[None, None, :],
                     mask=cmask[:, :, None] & cm[None, None, :], other=0.0).to(tl.float32)
        dz = tl.sum(dx, axis=1)
        tl.store(DZ + t[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty),
                 mask=tmask[:, None] & cm[None, :])


@triton.jit
def _combine_fwd_kernel(Y, W, INV, U, N, L, stride_y, stride_u, TOP_K: tl.constexpr, KP: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    t, r, tmask, cmask = _copies(INV, N, TOP_K, KP, BLOCK_T)
    w = tl.load(W + t[:, None] * TOP_K + tl.arange(0, KP)[None, :], mask=cmask, other=0.0).to(tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        y = tl.load(Y + r[:, :, None] * stride_y + cols[None, None, :],
                    mask=cmask[:, :, None] & cm[None, None, :], other=0.0).to(tl.float32)
        u = tl.sum(w[:, :, None] * y, axis=1)
        tl.store(U + t[:, None] * stride_u + cols[None, :], u.to(U.dtype.element_ty),
                 mask=tmask[:, None] & cm[None, :])


@triton.jit
def _combine_bwd_kernel(DU, Y, W, INV, DY, DW, PAD_ROWS, N, P, L, stride_du, stride_y, stride_dy,
                        TOP_K: tl.constexpr, KP: tl.constexpr, NEED_DY: tl.constexpr,
                        NEED_DW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """Programs [0, ⌈N / BLOCK_T⌉) take tokens; the rest (NEED_DY) zero dy's P padding rows ``PAD_ROWS``."""
    token_programs = tl.cdiv(N, BLOCK_T)
    if NEED_DY:
        if tl.program_id(0) >= token_programs:
            _zero_pad_rows(DY, PAD_ROWS, P, L, stride_dy, tl.program_id(0) - token_programs, KP, BLOCK_T, BLOCK_L)
            return
    t, r, tmask, cmask = _copies(INV, N, TOP_K, KP, BLOCK_T)
    wofs = t[:, None] * TOP_K + tl.arange(0, KP)[None, :]
    if NEED_DY:
        w = tl.load(W + wofs, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        m3 = cmask[:, :, None] & cm[None, None, :]
        du = tl.load(DU + t[:, None] * stride_du + cols[None, :], mask=tmask[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)
        if NEED_DY:
            tl.store(DY + r[:, :, None] * stride_dy + cols[None, None, :],
                     (w[:, :, None] * du[:, None, :]).to(DY.dtype.element_ty), mask=m3)
        if NEED_DW:
            y = tl.load(Y + r[:, :, None] * stride_y + cols[None, None, :], mask=m3,
                        other=0.0).to(tl.float32)
            dw += tl.sum(y * du[:, None, :], axis=2)
    if NEED_DW:
        tl.store(DW + wofs, dw.to(DW.dtype.element_ty), mask=cmask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_dispatch_fwd_kernel, InterpretedFunction)


def _launch(n: int, ell: int, top_k: int, t: torch.Tensor, pad: int = 0):
    """(grid, launch options) for n tokens of k copies of ℓ columns on t's device, and programs for ``pad``
    padding rows after the tokens' (as many rows a program as a token program has copies)."""
    kp = triton.next_power_of_2(top_k)
    if t.is_cuda:
        bl = min(GPU_MAX_BLOCK_L, max(16, triton.next_power_of_2(ell)))
        bt, opts = max(1, GPU_TILE_ELEMS // (kp * bl)), {"num_warps": GPU_NUM_WARPS}
    elif interpreter_active():
        (bt, bl), opts = INTERPRET_BLOCKS, {}
    else:
        raise RuntimeError("the Triton MoE permute kernels got a CPU tensor, but Triton's interpreter "
                           "is off: set TRITON_INTERPRET=1 before triton is imported, or use "
                           "backend='torch'")
    return (triton.cdiv(n, bt) + triton.cdiv(pad, bt * kp),), {"TOP_K": top_k, "KP": kp, "BLOCK_T": bt,
                                                                "BLOCK_L": bl, **opts}


def _check(rows: tuple[torch.Tensor, ...], inverse: torch.Tensor, n: int, top_k: int) -> None:
    """2-D row tensors with a contiguous last dim (unless empty) and a contiguous [n·k] index, all
    on one device."""
    dev = inverse.device
    for x in rows:
        if x.ndim != 2 or x.device != dev or (x.numel() and x.shape[1] > 1 and x.stride(1) != 1):
            raise ValueError(f"expected 2-D row tensors with a contiguous last dim on {dev}, got "
                             f"{[(tuple(x.shape), x.stride(), str(x.device)) for x in rows]}")
    if inverse.shape != (n * top_k,) or not inverse.is_contiguous() or inverse.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"inverse must be a contiguous int32/int64 [{n}·{top_k}] tensor, got "
                         f"{tuple(inverse.shape)} {inverse.dtype}")


def _padding(pad_rows: torch.Tensor | None, inverse: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(PAD_ROWS, P) kernel arguments: ``pad_rows`` and its length, or a dummy pointer and 0."""
    if pad_rows is None:
        return inverse, 0
    _check((), pad_rows, pad_rows.numel(), 1)
    return pad_rows, pad_rows.numel()


def dispatch_forward(z: torch.Tensor, inverse: torch.Tensor, top_k: int, pad_rows: torch.Tensor | None = None,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z [N, ℓ] → x [N·k + P, ℓ] (contiguous, z.dtype) with x[inverse[i·k + j]] = z[i] and the P rows
    ``pad_rows`` (none by default) zero; with ``weights`` [N, k] (contiguous) in the same launch also their rows
    xw [N·k + P] (weights' dtype), xw[inverse[i·k + j]] = weights[i, j], 0 on the padding rows (else None)."""
    n, ell = z.shape
    _check((z,), inverse, n, top_k)
    pad_arg, pad = _padding(pad_rows, inverse)
    if weights is not None and (weights.shape != (n, top_k) or not weights.is_contiguous()
                                or weights.device != z.device):
        raise ValueError(f"weights must be contiguous [{n}, {top_k}] on {z.device}, got {tuple(weights.shape)} "
                         f"on {weights.device}")
    x = torch.empty((n * top_k + pad, ell), dtype=z.dtype, device=z.device)
    xw = None if weights is None else weights.new_empty(n * top_k + pad)
    if (n or pad) and (ell or xw is not None):
        grid, meta = _launch(n, max(ell, 1), top_k, z, pad)
        _dispatch_fwd_kernel[grid](z, x if xw is None else weights, inverse, x, x if xw is None else xw, pad_arg, n,
                                   pad, ell, z.stride(0), x.stride(0), HAS_W=xw is not None, **meta)
    return x, xw


def dispatch_backward(dx: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype | None = None,
                      d_row_weights: torch.Tensor | None = None, w_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx [N·k + P, ℓ] → dz [N, ℓ] (contiguous, ``dtype`` or dx.dtype), dz[i] = Σ_j dx[inverse[i·k + j]] (padding
    rows are not read); with ``d_row_weights`` [N·k + P] (the gradient of dispatch_forward's xw) in the same launch
    also dweights [N, k] (``w_dtype``), dweights[i, j] = d_row_weights[inverse[i·k + j]] (else None)."""
    ell = dx.shape[1]
    n = inverse.numel() // top_k
    _check((dx,), inverse, n, top_k)
    if d_row_weights is not None and (d_row_weights.shape != dx.shape[:1] or not d_row_weights.is_contiguous()):
        raise ValueError(f"d_row_weights must be a contiguous [{dx.shape[0]}], got {tuple(d_row_weights.shape)}")
    dz = torch.empty((n, ell), dtype=dtype or dx.dtype, device=dx.device)
    dw = None if d_row_weights is None else torch.empty((n, top_k), dtype=w_dtype or d_row_weights.dtype,
                                                         device=dx.device)
    if n and (ell or dw is not None):
        grid, meta = _launch(n, max(ell, 1), top_k, dx)
        _dispatch_bwd_kernel[grid](dx, dx if dw is None else d_row_weights, inverse, dz, dz if dw is None else dw, n,
                                   ell, dx.stride(0), dz.stride(0), HAS_W=dw is not None, **meta)
    return dz, dw


def combine_forward(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """y [N·k + P, ℓ], weights [N, k] (contiguous) → u [N, ℓ] (contiguous, y.dtype),
    u[i] = Σ_j weights[i, j] · y[inverse[i·k + j]] (padding rows are not read)."""
    n, top_k = weights.shape
    ell = y.shape[1]
    _check((y, weights), inverse, n, top_k)
    if y.shape[0] < n * top_k or not weights.is_contiguous():
        raise ValueError(f"y {tuple(y.shape)} needs ≥ N·k rows for contiguous weights {tuple(weights.shape)}")
    u = torch.empty((n, ell), dtype=y.dtype, device=y.device)
    if u.numel():
        grid, meta = _launch(n, ell, top_k, y)
        _combine_fwd_kernel[grid](y, weights, inverse, u, n, ell, y.stride(0), u.stride(0), **meta)
    return u


def combine_backward(du: torch.Tensor, y: torch.Tensor | None, weights: torch.Tensor | None,
                     inverse: torch.Tensor, top_k: int, y_dtype: torch.dtype, w_dtype: torch.dtype,
                     pad_rows: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dy [N·k + P, ℓ] in y_dtype, its P rows ``pad_rows`` zero; dweights [N, k] in w_dtype) from du [N, ℓ]:
    dy needs ``weights`` and dweights needs ``y``; each is None where its input is None."""
    n, ell = du.shape
    need_dy, need_dw = weights is not None, y is not None
    _check((du,) + ((y,) if need_dw else ()), inverse, n, top_k)
    pad_arg, pad = _padding(pad_rows, inverse)
    if need_dy and (weights.shape != (n, top_k) or not weights.is_contiguous()):
        raise ValueError(f"weights must be contiguous [{n}, {top_k}], got {tuple(weights.shape)}")
    if need_dw and y.shape != (n * top_k + pad, ell):
        raise ValueError(f"y must be [{n}·{top_k} + {pad}, {ell}], got {tuple(y.shape)}")
    dy = torch.empty((n * top_k + pad, ell), dtype=y_dtype, device=du.device) if need_dy else None
    dw = torch.empty((n, top_k), dtype=w_dtype, device=du.device) if need_dw else None
    if (n or (pad and need_dy)) and (need_dy or need_dw):
        grid, meta = _launch(n, ell, top_k, du, pad if need_dy else 0)
        _combine_bwd_kernel[grid](du, y if need_dw else du, weights if need_dy else du, inverse,
                                  dy if need_dy else du, dw if need_dw else du, pad_arg, n, pad, ell, du.stride(0),
                                  y.stride(0) if need_dw else 0, dy.stride(0) if need_dy else 0,
                                  NEED_DY=need_dy, NEED_DW=need_dw, **meta)
    return dy, dw
