"""The routed experts' math, in plain torch: the test reference of ``kernels.moe_experts``.

Grouped rows m = 0 … N·k − 1 are token copies sorted by expert (row m is token order[m] // k; expert e
owns rows offsets[e − 1] … offsets[e] − 1, offsets cumulative with an implied 0 in front):

    x_m = z[order[m] // k],   [gate | up]_m = W13[e] x_m,   h_m = SiTU(gate_m, up_m),   y_m = W2[e] h_m

with W13 [E, 2I, ℓ] (gate rows, then up rows) and W2 [E, ℓ, I]; one matmul pair per expert, in the
inputs' dtype, differentiated by torch autograd.
"""

from __future__ import annotations

import torch

from ..situ.reference import situ_forward


def routed_experts(z: torch.Tensor, order: torch.Tensor, top_k: int, offsets: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """z [N, ℓ], order [N·k], offsets [E] → y [N·k, ℓ] (grouped rows)."""
    x = z[order // top_k]
    I = w13.shape[1] // 2
    bounds = [0] + offsets.tolist()
    ys = []
    for e in range(w13.shape[0]):
        gu = x[bounds[e]:bounds[e + 1]] @ w13[e].t()
        ys.append(situ_forward(gu[:, :I], gu[:, I:], beta, linear_beta) @ w2[e].t())
    return torch.cat(ys)
