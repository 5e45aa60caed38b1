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
- Each step is three batched GEMMs: ``bmm`` and two ``baddbmm`` whose alpha/beta carry
  the polynomial coefficients, so no extra elementwise passes are needed.
- ``scale`` is folded into the alpha/beta of the last step (free).
- Compute dtype: bf16 on CUDA, fp32 elsewhere (CPU has no fast bf16 GEMM and the CPU tests
  compare against fp32 references). The Frobenius norm is always taken in fp32.

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
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a [m, n] or [B, m, n] tensor, got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz needs at least one step, got {steps}")
    squeeze = G.ndim == 2
    if squeeze:
        G = G.unsqueeze(0)
    if dtype is None:
        dtype = default_ns_dtype(G.device)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        G = G.mT
    a, b, c = coeffs

    # X = G / (||G||_F + eps), written straight into the compute dtype (one pass).
    norm_dtype = torch.promote_types(G.dtype, torch.float32)
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    X = torch.empty(G.shape, dtype=dtype, device=G.device)
    torch.div(G, norm.add_(eps), out=X)

    for i in range(steps):
        s = scale if i == steps - 1 else 1.0
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a * s, alpha=s)

    if tall:
        X = X.mT
    if squeeze:
        X = X.squeeze(0)
    return X
