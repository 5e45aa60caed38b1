"""Plain-torch SiTU-GLU: the forward and its analytic backward, in fp32.

With a = gate, c = up (both [..., I]) and σ the logistic function::

    g(a) = β·tanh(a/β)·σ(a),   h(c) = β_lin·tanh(c/β_lin),   SiTU(a, c) = g(a)·h(c)

    ∂SiTU/∂a = h(c)·σ(a)·[sech²(a/β) + β·tanh(a/β)·σ(−a)]    (σ'(a) = σ(a)·σ(−a))
    ∂SiTU/∂c = g(a)·sech²(c/β_lin)

|SiTU| ≤ β·β_lin. sech² is taken as 1/cosh², which keeps its relative accuracy where
tanh saturates (1 − tanh² cancels there).
"""

from __future__ import annotations

import torch


def situ_forward(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """SiTU(gate, up) computed in fp32 (times ``row_scale`` [...] row by row, if given) and returned in
    ``gate.dtype``; differentiable."""
    a, c = gate.float(), up.float()
    h = linear_beta * torch.tanh(c / linear_beta)
    out = beta * torch.tanh(a / beta) * torch.sigmoid(a) * h
    if row_scale is not None:
        out = out * row_scale.float().unsqueeze(-1)
    return out.to(gate.dtype)


def _sech2(x: torch.Tensor) -> torch.Tensor:
    return torch.cosh(x).square().reciprocal()  # cosh = inf for |x| > 89: sech² = 0


def situ_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, beta: float = 4.0,
                  linear_beta: float = 25.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) = grad_out·(∂SiTU/∂a, ∂SiTU/∂c), fp32 tensors of gate's shape."""
    a, c, go = gate.float(), up.float(), grad_out.float()
    ta, sa = torch.tanh(a / beta), torch.sigmoid(a)
    h = linear_beta * torch.tanh(c / linear_beta)
    dg = sa * (_sech2(a / beta) + beta * ta * torch.sigmoid(-a))
    return go * h * dg, go * (beta * ta * sa) * _sech2(c / linear_beta)
