"""Batched Newton–Schulz for blocks of more than 128 rows: Triton GEMMs with the step's epilogues.

The fused kernel (``triton_ns.py``) keeps the Gram matrix of a block in registers, which holds only
up to 128 rows. Larger wide blocks X [M, N] (bench-1B's 4,608 expert blocks are [256, 512]) run each
step as three batched GEMMs, as ``torch_ns.newton_schulz`` does, but through one Triton kernel
(``_ns_gemm_kernel``, grid = (output tiles, matrices)) that computes

    out[b] = OUT_SCALE[b] · (c0 · C'[b] + c1 · L'[b] @ R'[b] + c2 · I),   L' = IN_SCALE[b] · L (same for R, C)

with fp32 accumulation, so that

    A  = X Xᵀ                (symmetric: only tiles i ≤ j are computed, each stored twice)
    B  = b A + c A²          (symmetric as well; same halving)
    X' = a X + B X           (the last step scales by ``scale``)

The first step runs on G itself (no normalization pass), as the torch version does: the Gram kernel
also writes each diagonal tile's trace of G Gᵀ, so 1/s = 1/(‖G‖_F + eps) comes from [B] sums, and
the second GEMM reads A scaled by 1/s² (IN_SCALE), then multiplies by 1/s (OUT_SCALE):
B = (b A/s² + c A²/s⁴ + a I)/s, X₁ = B G. Skipping the lower tiles saves a quarter of the FLOPs of
the first two GEMMs of a [256, ·] block (3 of 4 output tiles).

Dots take bf16 operands on GPU (fp32 accumulate); fp32 operands (IEEE products, no TF32) when the
compute dtype is fp32 or under ``TRITON_INTERPRET=1`` (DESIGN.md §7). Outputs are written in the compute
dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.newton_schulz.torch_ns import NS_COEFFS, NS_STEPS, unwide, wide_batch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing
    triton = None

# GPU tiles (not tuned); the interpreter takes small tiles so the tests cover several of them.
GPU_TILES = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
INTERPRET_TILES = dict(BM=32, BN=32, BK=16)


if triton is not None:

    @triton.jit
    def _ns_gemm_kernel(
        L, R, C, OUT, TRACE, IN_SCALE, OUT_SCALE,
        M, N, K, tiles_n,
        s_lb, s_lm, s_lk, s_rb, s_rk, s_rn, s_cb, s_cm, s_cn, s_ob, s_om, s_on,
        c0, c1, c2,
        SYMMETRIC: tl.constexpr, ADD_C: tl.constexpr, ADD_I: tl.constexpr, WANT_TRACE: tl.constexpr,
        HAS_IN_SCALE: tl.constexpr, HAS_OUT_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        ti = tl.program_id(0) // tiles_n
        tj = tl.program_id(0) % tiles_n
        if SYMMETRIC and ti > tj:  # the lower tile is written by its mirror program
            return
        b = tl.program_id(1).to(tl.int64)
        rm = ti * BM + tl.arange(0, BM)
        rn = tj * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        if HAS_IN_SCALE:
            s_in = tl.load(IN_SCALE + b)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            lt = tl.load(L + b * s_lb + rm[:, None] * s_lm + kk[None, :] * s_lk,
                         mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            rt = tl.load(R + b * s_rb + kk[:, None] * s_rk + rn[None, :] * s_rn,
                         mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if HAS_IN_SCALE:
                lt = (lt.to(tl.float32) * s_in).to(lt.dtype)
                rt = (rt.to(tl.float32) * s_in).to(rt.dtype)
            if DOT_FP32:  # fp32 compute: exact fp32 products, as torch's fp32 bmm with TF32 off
                acc = tl.dot(lt.to(tl.float32), rt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(lt, rt, acc)
        diag = rm[:, None] == rn[None, :]
        if WANT_TRACE:  # this tile's share of tr(L R): [B, tiles_n] partial sums
            if ti == tj:
                tl.store(TRACE + b * tiles_n + ti, tl.sum(tl.sum(tl.where(diag, acc, 0.0), axis=1), axis=0))
        out = acc * c1
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        if ADD_C:
            ct = tl.load(C + b * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=ok, other=0.0)
            if HAS_IN_SCALE:
                ct = (ct.to(tl.float32) * s_in).to(ct.dtype)
            out += c0 * ct.to(tl.float32)
        if ADD_I:
            out += tl.where(diag, c2, 0.0)
        if HAS_OUT_SCALE:
            out *= tl.load(OUT_SCALE + b)
        out = out.to(OUT.dtype.element_ty)
        tl.store(OUT + b * s_ob + rm[:, None] * s_om + rn[None, :] * s_on, out, mask=ok)
        if SYMMETRIC and ti != tj:
            tl.store(OUT + b * s_ob + rn[None, :] * s_om + rm[:, None] * s_on, out, mask=ok)


def _interpret() -> bool:
    """Whether the kernel was built for Triton's interpreter (decided when triton was imported)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_ns_gemm_kernel, InterpretedFunction)


def tiled_supports(G: torch.Tensor) -> bool:
    """Whether ``newton_schulz_tiled`` runs ``G`` with its kernel (CUDA, or CPU under the interpreter)."""
    return triton is not None and G.ndim in (2, 3) and (G.is_cuda or (G.device.type == "cpu" and _interpret()))


def _gemm(L, R, out, *, c1=1.0, C=None, c0=0.0, c2=None, symmetric=False, trace=None, in_scale=None,
          out_scale=None, dot_fp32=False):
    """out[b] = out_scale[b]·(c0·C'[b] + c1·L'[b] @ R'[b] + c2·I) over [B, M, K] @ [B, K, N] (see the
    module docstring); ``trace`` ([B, tiles] fp32) receives the diagonal tiles' traces of L R."""
    Bsz, M, K = L.shape
    N = R.shape[-1]
    tiles = INTERPRET_TILES if _interpret() else GPU_TILES
    BM, BN = tiles["BM"], tiles["BN"]
    if symmetric and BM != BN:
        raise ValueError("symmetric products need square tiles")
    tiles_m, tiles_n = triton.cdiv(M, BM), triton.cdiv(N, BN)
    dummy = out  # unused pointer arguments (their flags are off)
    Cp = C if C is not None else dummy
    _ns_gemm_kernel[(tiles_m * tiles_n, Bsz)](
        L, R, Cp, out, trace if trace is not None else dummy,
        in_scale if in_scale is not None else dummy, out_scale if out_scale is not None else dummy,
        M, N, K, tiles_n,
        L.stride(0), L.stride(1), L.stride(2), R.stride(0), R.stride(1), R.stride(2),
        Cp.stride(0), Cp.stride(1), Cp.stride(2), out.stride(0), out.stride(1), out.stride(2),
        float(c0), float(c1), float(c2 or 0.0),
        SYMMETRIC=symmetric, ADD_C=C is not None, ADD_I=c2 is not None, WANT_TRACE=trace is not None,
        HAS_IN_SCALE=in_scale is not None, HAS_OUT_SCALE=out_scale is not None, DOT_FP32=dot_fp32,
        **tiles,
    )
    return out


def newton_schulz_tiled(
    G: torch.Tensor,
    steps: int = NS_STEPS,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
    scale: float = 1.0,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Same contract and math as ``torch_ns.newton_schulz`` ([m, n] or [B, m, n] → ``scale · NS(G)`` in
    the compute dtype; a transposed view when m > n), every GEMM through ``_ns_gemm_kernel``."""
    G, squeeze, tall, dtype = wide_batch(G, steps, dtype)  # a tall G: a transposed view, read in place
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the tiled Newton–Schulz computes in bf16 or fp32, got {dtype}")
    X = G.to(dtype)
    Bsz, M, N = X.shape
    a, b, c = coeffs
    dot_fp32 = _interpret() or dtype == torch.float32
    tiles = INTERPRET_TILES if _interpret() else GPU_TILES
    A = torch.empty((Bsz, M, M), dtype=dtype, device=X.device)
    Bm = torch.empty_like(A)

    # Step 1 on G: A = G Gᵀ with its trace, then B = (b A/s² + c A²/s⁴ + a I)/s and X₁ = B G.
    trace = torch.empty((Bsz, triton.cdiv(M, tiles["BM"])), dtype=torch.float32, device=X.device)
    _gemm(X, X.mT, A, symmetric=True, trace=trace, dot_fp32=dot_fp32)
    inv = (trace.sum(1).sqrt() + eps).reciprocal()  # 1/s [B]
    s1 = scale if steps == 1 else 1.0
    _gemm(A, A, Bm, c1=c, C=A, c0=b, c2=a, symmetric=True, in_scale=inv * inv, out_scale=inv * s1,
          dot_fp32=dot_fp32)
    X = _gemm(Bm, X, torch.empty((Bsz, M, N), dtype=dtype, device=X.device), dot_fp32=dot_fp32)
    spare = torch.empty_like(X) if steps > 1 else None  # X' is written beside X: its tiles read all of X
    for i in range(1, steps):
        s = scale if i == steps - 1 else 1.0
        _gemm(X, X.mT, A, symmetric=True, dot_fp32=dot_fp32)
        _gemm(A, A, Bm, c1=c, C=A, c0=b, symmetric=True, dot_fp32=dot_fp32)
        X, spare = _gemm(Bm, X, spare, c1=s, C=X, c0=a * s, dot_fp32=dot_fp32), X
    return unwide(X, squeeze, tall)
