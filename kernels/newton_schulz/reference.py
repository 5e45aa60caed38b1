"""Plain one-matrix float64 reference of the quintic Newton–Schulz iteration (``torch_ns.py``), for tests."""

from __future__ import annotations

import torch

from kernels.newton_schulz.torch_ns import NS_COEFFS, NS_STEPS


def newton_schulz_reference(G: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """G [m, n] → NS(G) [m, n] in float64: the iteration of ``newton_schulz``, one matrix, no batching."""
    X = G.to(torch.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + eps)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if tall else X
