"""RMSNorm in plain torch: the reference of the Triton kernels and the CPU path.

    r = 1/√(mean_j x_j² + eps)          per row, fp32
    y = (x·r)·w                          fp32, returned in x.dtype (or ``out_dtype``)
    y = (x·r)·w·σ(g)                     with gate logits g (same shape as x; gated, as KDA's output)

Backward (x̂ = x·r, all fp32; gated: dg = dy⊙(x̂·w)·σ(1−σ), then dy ← dy⊙σ):

    dx = r·(w⊙dy − x̂·mean_j(x̂_j w_j dy_j))          in x.dtype
    dw = Σ_rows dy⊙x̂                                in w.dtype
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` [..., n] in fp32 and scale by ``weight`` [n] (and by σ(gate),
    gate [..., n] logits); out in ``out_dtype`` (default x.dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    return y.to(out_dtype or x.dtype)
