"""Triton SiTU-GLU: one elementwise forward kernel and one backward kernel.

Both take 2-D [M, I] views whose last dimension is contiguous and whose row strides are
free (so the halves of a packed [M, 2I] gate_up tensor go in without a copy). A program
handles a [BLOCK_M, BLOCK_N] tile on a (row blocks, column blocks) grid; loads are cast
to fp32, all math is fp32, and stores cast to the output's dtype. The backward recomputes
g, h and their derivatives from gate, up and grad_out (math in ``reference.py``) and
writes dgate and dup through separate pointers, which may be the two halves of one
packed [M, 2I] buffer.

tanh and sech² use only ``tl.exp`` (libdevice is not available in the interpreter):
with e = exp(−2|x|) and r = 1/(1 + e),

    tanh|x| = (1 − e)·r,   sech² x = 4e·r²

and, for |x| < 0.625, where 1 − e cancels, the odd Taylor series of tanh through x¹⁷.
Both stay within a few ulp of fp32 for every x, and nothing overflows: e ≤ 1, and σ is
formed from exp(−|x|) in the same way. That is for fp32 outputs. A half-precision output
(bf16, fp16) rounds at 2^-9 or 2^-12 relative, so there the kernels take tanh x = x below
|x| = 2^-6 (relative error x²/3 ≤ 8.2e-5) instead of the series: within ``HALF_RTOL`` of
each term, and the kernels are bound by instruction issue, not bytes (sm_90 SASS by
``benchmarks/kernel_sass.py``, 8 elements a thread, Triton 3.6: 89 instructions an element
forward and 124 backward with the series at every precision, 69 and 88 with the half-precision
path; docs/decisions.md).

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` must be set
before triton is imported). The interpreter truncates fp32 → bf16 stores; GPUs round to
nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# GPU tiles: GPU_BLOCK_ELEMS elements a program. Swept with benchmarks/moe_components.py --situ-tiles on one
# H200 ([131072, 2·256] bf16 gate|up, fwd+bwd, CUDA-graph replays;
# docs/results/moe_components_situ_tiles_h200_2026-12-01.json): 1024 × 4 warps 0.237 ms, 2048 × 4 0.249,
# 4096 × 8 0.275, 2048 × 2 0.328, 4096 × 4 0.330, 8192 × 8 0.356. The interpreter takes small tiles so that
# tests cover several blocks and the masked edges.
# The half-precision outputs' tanh: x itself below this |x|; the error bound it keeps against each term.
HALF_TANH_LINEAR = tl.constexpr(2.0**-6)
HALF_RTOL = 2.0**-12
GPU_BLOCK_ELEMS = 1024
GPU_MAX_BLOCK_N = 256
GPU_NUM_WARPS = 4
INTERPRET_BLOCKS = (16, 32)


@triton.jit
def _tanh_sech2(x, EXACT: tl.constexpr):
    """(tanh x, sech² x) in fp32: a few ulp from exact for all x with ``EXACT``, else tanh within
    HALF_RTOL relative (for half-precision outputs)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    r = 1.0 / (1.0 + e)
    big = (1.0 - e) * r
    sech2 = 4.0 * e * r * r
    if EXACT:
        # tanh x = x + x·z·P(z), z = x², P from the Taylor coefficients 2^2n (2^2n − 1) B_2n / (2n)!
        z = x * x
        p = z * (6404582.0 / 10854718875.0) - 929569.0 / 638512875.0
        p = p * z + 21844.0 / 6081075.0
        p = p * z - 1382.0 / 155925.0
        p = p * z + 62.0 / 2835.0
        p = p * z - 17.0 / 315.0
        p = p * z + 2.0 / 15.0
        p = p * z - 1.0 / 3.0
        t = tl.where(ax < 0.625, x + x * z * p, tl.where(x < 0, -big, big))
    else:
        t = tl.where(ax < HALF_TANH_LINEAR, x, tl.where(x < 0, -big, big))
    return t, sech2


@triton.jit
def _sigmoid_pair(x):
    """(σ(x), σ(−x)): with z = exp(−|x|), σ(|x|) = 1/(1 + z) and σ(−|x|) = z/(1 + z)."""
    z = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + z)
    pos = x >= 0
    return tl.where(pos, r, z * r), tl.where(pos, z * r, r)


@triton.jit
def _tile(M, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row indices [BLOCK_M, 1] (int64), column indices [1, BLOCK_N] and the in-bounds mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = rows[:, None], cols[None, :]
    return rows, cols, (rows < M) & (cols < I)


@triton.jit
def situ_math(a, c, beta, linear_beta, EXACT: tl.constexpr):
    """SiTU(a, c) of fp32 tiles (``EXACT``: see ``_tanh_sech2``)."""
    ta, _ = _tanh_sech2(a * (1.0 / beta), EXACT)
    tc, _ = _tanh_sech2(c * (1.0 / linear_beta), EXACT)
    sa, _ = _sigmoid_pair(a)
    return beta * ta * sa * (linear_beta * tc)


@triton.jit
def situ_grad_math(a, c, go, beta, linear_beta, EXACT: tl.constexpr):
    """(dgate, dup, SiTU) of fp32 tiles from gate a, up c and the output's gradient go."""
    ta, sech2_a = _tanh_sech2(a * (1.0 / beta), EXACT)
    tc, sech2_c = _tanh_sech2(c * (1.0 / linear_beta), EXACT)
    sa, sna = _sigmoid_pair(a)
    g = beta * ta * sa
    h = linear_beta * tc
    dg = sa * (sech2_a + beta * ta * sna)
    return go * h * dg, go * g * sech2_c, g * h


@triton.jit
def _situ_fwd_kernel(G, U, S, O, M, I, stride_g, stride_u, stride_o, beta, linear_beta,
                     HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(M, I, BLOCK_M, BLOCK_N)
    a = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = situ_math(a, c, beta, linear_beta, O.dtype.element_ty == tl.float32)
    if HAS_SCALE:
        out *= tl.load(S + rows, mask=rows < M, other=0.0).to(tl.float32)
    tl.store(O + rows * stride_o + cols, out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(G, U, DO, DG, DU, S, DS, M, I, stride_g, stride_u, stride_do, stride_dg,
                     stride_du, beta, linear_beta, HAS_SCALE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(M, I, BLOCK_M, BLOCK_N)
    a = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(DO + rows * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    dgate, dup, value = situ_grad_math(a, c, go, beta, linear_beta, DG.dtype.element_ty == tl.float32)
    if HAS_SCALE:  # out = s·SiTU: ds = Σ_cols go·SiTU (this program's columns: DS [M, column blocks]); d· → s·d·
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(DS + row * tl.num_programs(1) + tl.program_id(1), tl.sum(go * value, axis=1), mask=row < M)
        scale = tl.load(S + rows, mask=rows < M, other=0.0).to(tl.float32)
        dgate *= scale
        dup *= scale
    tl.store(DG + rows * stride_dg + cols, dgate.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + rows * stride_du + cols, dup.to(DU.dtype.element_ty), mask=mask)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_situ_fwd_kernel, InterpretedFunction)


def _launch(M: int, I: int, t: torch.Tensor):
    """(grid, launch options) for an [M, I] problem on t's device."""
    if t.is_cuda:
        bn = min(GPU_MAX_BLOCK_N, max(16, triton.next_power_of_2(I)))
        bm, opts = GPU_BLOCK_ELEMS // bn, {"num_warps": GPU_NUM_WARPS}
    elif interpreter_active():
        (bm, bn), opts = INTERPRET_BLOCKS, {}
    else:
        raise RuntimeError("the Triton SiTU kernels got a CPU tensor, but Triton's interpreter is "
                           "off: set TRITON_INTERPRET=1 before triton is imported, or use "
                           "backend='torch'")
    return (triton.cdiv(M, bm), triton.cdiv(I, bn)), {"BLOCK_M": bm, "BLOCK_N": bn, **opts}


def _check_rows(*ts: torch.Tensor) -> None:
    """All [M, I] with a contiguous last dim (unless empty), on one device."""
    for t in ts:
        if t.ndim != 2 or t.shape != ts[0].shape or t.device != ts[0].device or (
                t.numel() and t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"expected [M, I] views with a contiguous last dim on one device, got "
                             f"{[(tuple(x.shape), x.stride(), str(x.device)) for x in ts]}")


def _check_scale(scale: torch.Tensor | None, M: int, device: torch.device) -> None:
    if scale is not None and (scale.shape != (M,) or not scale.is_contiguous() or scale.device != device):
        raise ValueError(f"row_scale must be a contiguous [{M}] tensor on {device}, got {tuple(scale.shape)} "
                         f"on {scale.device}")


def situ_forward(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [M, I] (rows may be strided) → SiTU(gate, up), each row times row_scale [M] if given:
    contiguous [M, I], gate.dtype."""
    _check_rows(gate, up)
    M, I = gate.shape
    _check_scale(row_scale, M, gate.device)
    out = torch.empty((M, I), dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid, meta = _launch(M, I, gate)
        _situ_fwd_kernel[grid](gate, up, gate if row_scale is None else row_scale, out, M, I, gate.stride(0),
                               up.stride(0), out.stride(0), float(beta), float(linear_beta),
                               HAS_SCALE=row_scale is not None, **meta)
    return out


def situ_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, dgate: torch.Tensor,
                  dup: torch.Tensor, beta: float, linear_beta: float,
                  row_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Write grad_out·∂out/∂gate into dgate and grad_out·∂out/∂up into dup (all [M, I], rows may be strided;
    dgate and dup may be the halves of one [M, 2I] buffer), out = SiTU or row_scale·SiTU; with row_scale,
    return ∂out/∂row_scale·grad_out = Σ_cols grad_out·SiTU, [M] fp32 (per column block, then summed: no atomics)."""
    _check_rows(gate, up, grad_out, dgate, dup)
    M, I = gate.shape
    _check_scale(row_scale, M, gate.device)
    if not M * I:
        return None if row_scale is None else torch.zeros(M, dtype=torch.float32, device=gate.device)
    grid, meta = _launch(M, I, gate)
    partial = None if row_scale is None else torch.empty(M, grid[1], dtype=torch.float32, device=gate.device)
    _situ_bwd_kernel[grid](gate, up, grad_out, dgate, dup, gate if row_scale is None else row_scale,
                           gate if partial is None else partial, M, I, gate.stride(0), up.stride(0),
                           grad_out.stride(0), dgate.stride(0), dup.stride(0), float(beta), float(linear_beta),
                           HAS_SCALE=row_scale is not None, **meta)
    return None if partial is None else partial.sum(1)
