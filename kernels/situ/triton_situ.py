"""Triton SiTU-GLU: one elementwise forward kernel and one backward kernel.

Both take gate and up as 2-D [M, I] views in one of two layouts (free row strides either way):
two views with a contiguous last dim, or ``PAIRS``: the columns 0::2 and 1::2 of one interleaved
[M, 2I] tensor (gate_0, up_0, gate_1, ...), which the kernels load as contiguous [BLOCK_M,
2·BLOCK_N] tiles and split into gate and up (the backward joins dgate and dup the same way before
its store), so the pairs go in and out without a copy and with 16-byte vector loads and stores. The
split and join cost a layout change through shared memory: in sm_90 SASS (Triton 3.9, bf16, with
the row scale) the pairs take 73 and 104 instructions an element forward and backward, against 68
and 94 for two contiguous views and 77 and 115 for column-strided loads of the pairs; on one H200
(Triton 3.6, [131072, 2·256] bf16 with the row scale, CUDA-graph replays, one lease) 89.5–89.6 µs
forward and 129.8–134.0 µs backward against 79.9–83.4 and 119.5–123.1 for the blocked halves.
A program handles a [BLOCK_M, BLOCK_N] tile on a (row blocks, column blocks) grid; loads are cast
to fp32, all math is fp32, and stores cast to the output's dtype. The backward recomputes g, h and
their derivatives from gate, up and grad_out (math in ``reference.py``).

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
def _pair_tile(M, I, rows, BLOCK_N: tl.constexpr):
    """Columns [1, 2·BLOCK_N] of an interleaved [M, 2I] row that hold this program's pairs, and their mask."""
    pair_cols = 2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)[None, :]
    return pair_cols, (rows < M) & (pair_cols < 2 * I)


@triton.jit
def _load_gate_up(G, U, M, I, rows, cols, mask, stride_g, stride_u, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """(gate, up) fp32 tiles [BLOCK_M, BLOCK_N]: from G and U, or (``PAIRS``) from the interleaved rows at G."""
    if PAIRS:
        pair_cols, pair_mask = _pair_tile(M, I, rows, BLOCK_N)
        x = tl.load(G + rows * stride_g + pair_cols, mask=pair_mask, other=0.0)
        a, c = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N, 2)))
    else:
        a = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0)
        c = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0)
    return a.to(tl.float32), c.to(tl.float32)


@triton.jit
def _situ_fwd_kernel(G, U, S, O, M, I, stride_g, stride_u, stride_o, beta, linear_beta,
                     HAS_SCALE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(M, I, BLOCK_M, BLOCK_N)
    a, c = _load_gate_up(G, U, M, I, rows, cols, mask, stride_g, stride_u, PAIRS, BLOCK_M, BLOCK_N)
    out = situ_math(a, c, beta, linear_beta, O.dtype.element_ty == tl.float32)
    if HAS_SCALE:
        out *= tl.load(S + rows, mask=rows < M, other=0.0).to(tl.float32)
    tl.store(O + rows * stride_o + cols, out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(G, U, DO, DG, DU, S, DS, M, I, stride_g, stride_u, stride_do, stride_dg,
                     stride_du, beta, linear_beta, HAS_SCALE: tl.constexpr, PAIRS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(M, I, BLOCK_M, BLOCK_N)
    a, c = _load_gate_up(G, U, M, I, rows, cols, mask, stride_g, stride_u, PAIRS, BLOCK_M, BLOCK_N)
    go = tl.load(DO + rows * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    dgate, dup, value = situ_grad_math(a, c, go, beta, linear_beta, DG.dtype.element_ty == tl.float32)
    if HAS_SCALE:  # out = s·SiTU: ds = Σ_cols go·SiTU (this program's columns: DS [M, column blocks]); d· → s·d·
        row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(DS + row * tl.num_programs(1) + tl.program_id(1), tl.sum(go * value, axis=1), mask=row < M)
        scale = tl.load(S + rows, mask=rows < M, other=0.0).to(tl.float32)
        dgate *= scale
        dup *= scale
    dgate, dup = dgate.to(DG.dtype.element_ty), dup.to(DU.dtype.element_ty)
    if PAIRS:  # (dgate_j, dup_j) into columns (2j, 2j + 1) of the interleaved rows at DG
        pair_cols, pair_mask = _pair_tile(M, I, rows, BLOCK_N)
        tl.store(DG + rows * stride_dg + pair_cols, tl.reshape(tl.join(dgate, dup), (BLOCK_M, 2 * BLOCK_N)),
                 mask=pair_mask)
    else:
        tl.store(DG + rows * stride_dg + cols, dgate, mask=mask)
        tl.store(DU + rows * stride_du + cols, dup, mask=mask)


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
    """All [M, I] on one device."""
    for t in ts:
        if t.ndim != 2 or t.shape != ts[0].shape or t.device != ts[0].device:
            raise ValueError(f"expected [M, I] views of one shape on one device, got "
                             f"{[(tuple(x.shape), x.stride(), str(x.device)) for x in ts]}")


def _contiguous_cols(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 or t.shape[1] <= 1


def _is_pairs(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether gate and up are the columns 0::2 and 1::2 of one [M, 2I] tensor with a contiguous last dim."""
    return (gate.dtype == up.dtype and gate.stride(1) == 2 and up.stride() == gate.stride()
            and up.data_ptr() == gate.data_ptr() + gate.element_size())


def _layout(gate: torch.Tensor, up: torch.Tensor, names: str) -> bool:
    """True for interleaved pairs, False for two views with a contiguous last dim; else a ValueError."""
    if _is_pairs(gate, up):
        return True
    if _contiguous_cols(gate) and _contiguous_cols(up):
        return False
    raise ValueError(f"{names}: need two [M, I] views with a contiguous last dim, or the columns 0::2 and 1::2 of "
                     f"one [M, 2I] tensor with a contiguous last dim (interleaved pairs); got strides "
                     f"{gate.stride()} and {up.stride()}")


def _check_scale(scale: torch.Tensor | None, M: int, device: torch.device) -> None:
    if scale is not None and (scale.shape != (M,) or not scale.is_contiguous() or scale.device != device):
        raise ValueError(f"row_scale must be a contiguous [{M}] tensor on {device}, got {tuple(scale.shape)} "
                         f"on {scale.device}")


def situ_forward(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [M, I] (any row strides; contiguous last dims, or interleaved pairs: ``_layout``) → SiTU(gate,
    up), each row times row_scale [M] if given: contiguous [M, I], gate.dtype."""
    _check_rows(gate, up)
    M, I = gate.shape
    _check_scale(row_scale, M, gate.device)
    out = torch.empty((M, I), dtype=gate.dtype, device=gate.device)
    if out.numel():
        pairs = _layout(gate, up, "gate, up")
        grid, meta = _launch(M, I, gate)
        _situ_fwd_kernel[grid](gate, up, gate if row_scale is None else row_scale, out, M, I, gate.stride(0),
                               up.stride(0), out.stride(0), float(beta), float(linear_beta),
                               HAS_SCALE=row_scale is not None, PAIRS=pairs, **meta)
    return out


def situ_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, dgate: torch.Tensor,
                  dup: torch.Tensor, beta: float, linear_beta: float,
                  row_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Write grad_out·∂out/∂gate into dgate and grad_out·∂out/∂up into dup (all [M, I], any row strides; gate,
    up and dgate, dup either two views with contiguous last dims each or interleaved pairs each, ``_layout``;
    grad_out's last dim contiguous), out = SiTU or row_scale·SiTU; with row_scale,
    return ∂out/∂row_scale·grad_out = Σ_cols grad_out·SiTU, [M] fp32 (per column block, then summed: no atomics)."""
    _check_rows(gate, up, grad_out, dgate, dup)
    M, I = gate.shape
    _check_scale(row_scale, M, gate.device)
    if not M * I:
        return None if row_scale is None else torch.zeros(M, dtype=torch.float32, device=gate.device)
    pairs = _layout(gate, up, "gate, up")
    if _layout(dgate, dup, "dgate, dup") != pairs or not _contiguous_cols(grad_out):
        raise ValueError(f"dgate, dup must be laid out as gate, up ({'interleaved pairs' if pairs else 'two views'}) "
                         f"and grad_out's last dim contiguous; got strides {dgate.stride()}, {dup.stride()}, "
                         f"{grad_out.stride()}")
    grid, meta = _launch(M, I, gate)
    partial = None if row_scale is None else torch.empty(M, grid[1], dtype=torch.float32, device=gate.device)
    _situ_bwd_kernel[grid](gate, up, grad_out, dgate, dup, gate if row_scale is None else row_scale,
                           gate if partial is None else partial, M, I, gate.stride(0), up.stride(0),
                           grad_out.stride(0), dgate.stride(0), dup.stride(0), float(beta), float(linear_beta),
                           HAS_SCALE=row_scale is not None, PAIRS=pairs, **meta)
    return None if partial is None else partial.sum(1)
