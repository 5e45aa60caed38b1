"""Batched quintic Newton–Schulz orthogonalization (the core of Muon).

``newton_schulz(G)`` maps each matrix ``G_i`` of a batch ``[B, m, n]`` (or one ``[m, n]``)
to an approximation of ``U_i V_i^T`` from its SVD, i.e. it pushes every singular value
towards 1. Five steps of the quintic iteration

    A = X X^T,  B = b A + c A A,  X <- a X + B X,      (a, b, c) = (3.4445, -4.7750, 2.0315)

after normalizing by the Frobenius norm (so all singular values start <= 1). The
coefficients do not converge to exactly 1: after 5 steps singular values of a
well-conditioned input land in roughly [0.7, 1.2], which is what Muon needs.

Implementation notes
- Matrices are made "wide" (m <= n) by transposing, so A is the small Gram matrix.
- The Frobenius normalization is folded into the first step: with X = G / s,
  s = ||G||_F + eps and A_G = G G^T,

      ||G||_F^2 = tr(A_G),   A = A_G / s^2,   X_1 = (a I + B) X = ((a I + B) / s) G,

  so the first step runs on G itself (already in the compute dtype when the caller wrote it so:
  no normalization pass over [B, m, n], no copy) and the per-matrix scalars only touch the
  [B, m, m] matrices A and B. Later steps are three batched GEMMs each: ``bmm`` and two
  ``baddbmm`` whose alpha/beta carry the polynomial coefficients.
- ``scale`` is folded into the alpha/beta of the last step (free).
- Compute dtype: bf16 on CUDA, fp32 elsewhere (CPU has no fast bf16 GEMM and the CPU tests
  compare against fp32 references). The trace (the squared norm) is summed in fp32. The compute
  dtype must have fp32's exponent range (bf16, fp32, fp64): the Gram matrix of the unnormalized
  input would overflow fp16.

Imports only torch (``kernels/`` is a leaf); ``k3train.optim.newton_schulz`` re-exports it.
"""

from __future__ import annotations

from typing import Optional

import torch

NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
NS_STEPS: int = 5


def default_ns_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    G: torch.Tensor,
    steps: int = NS_STEPS,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
    scale: float = 1.0,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Orthogonalize ``G`` ([m, n] or [B, m, n]) with ``steps`` quintic NS iterations.

    Returns ``scale * NS(G)`` in the compute ``dtype`` (default: bf16 on CUDA, fp32
    otherwise), same shape as ``G``. The result may be a transposed view when ``m > n``.
    Every matrix of the batch is normalized and iterated independently, so a block's
    result does not depend on which other blocks share the call.
    """
    G, squeeze, tall, dtype = wide_batch(G, steps, dtype)
    a, b, c = coeffs

    # Step 1 on G itself (no normalization pass, no copy when G is already in the compute dtype).
    X = G.to(dtype)
    s1 = scale if steps == 1 else 1.0
    A = torch.bmm(X, X.mT)  # G G^T
    sq = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32)  # ||G||_F^2 per matrix
    inv = (sq.sqrt() + eps).reciprocal()[:, None, None]  # 1 / s, fp32 [B, 1, 1]
    A.mul_(inv * inv)
    B = torch.baddbmm(A, A, A, beta=b, alpha=c).mul_(inv * s1)
    B.diagonal(dim1=-2, dim2=-1).add_((a * s1) * inv[:, :, 0])
    X = torch.bmm(B, X)
    for i in range(1, steps):
        s = scale if i == steps - 1 else 1.0
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a * s, alpha=s)

    return unwide(X, squeeze, tall)


def wide_batch(G: torch.Tensor, steps: int, dtype: Optional[torch.dtype]
               ) -> tuple[torch.Tensor, bool, bool, torch.dtype]:
    """Checks ``newton_schulz``'s arguments; returns G as a wide [B, m, n] view (m <= n), whether it was
    2-D, whether it was tall (transposed), and the compute dtype (``dtype`` or the device's default)."""
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a [m, n] or [B, m, n] tensor, got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz needs at least one step, got {steps}")
    if dtype is None:
        dtype = default_ns_dtype(G.device)
    if dtype == torch.float16:
        raise ValueError(f"newton_schulz computes in bf16, fp32 or fp64 (an fp16 Gram matrix overflows), got {dtype}")
    squeeze = G.ndim == 2
    if squeeze:
        G = G.unsqueeze(0)
    tall = G.shape[-2] > G.shape[-1]
    return (G.mT if tall else G), squeeze, tall, dtype


def unwide(X: torch.Tensor, squeeze: bool, tall: bool) -> torch.Tensor:
    """Undoes ``wide_batch``'s view changes on a result."""
    if tall:
        X = X.mT
    return X.squeeze(0) if squeeze else X
