"""Plain-torch depthwise causal short conv with document resets (KDA's q/k/v conv, K3_SPEC.md §2.2).

x [B, T, C], weight [C, 1, W], position_ids [B, T] (position within the document; 0 starts one).
With the tap mask m_s[b, t] = [position_ids[b, t] ≥ s] · [t ≥ s] and w_s = weight[:, 0, W−1−s]::

    a[b, t]     = Σ_s w_s · x[b, t−s] · m_s[b, t]
    out         = a,  or SiLU(a) = a·σ(a) with ``silu`` (KDA's activation after the conv)
    ĝ           = g,  or g · σ(a)(1 + a(1 − σ(a))) with ``silu``     (g: the gradient of out)
    dx[b, t]    = Σ_s w_s · ĝ[b, t+s] · m_s[b, t+s]
    dw_s        = Σ_{b,t} ĝ[b, t] · x[b, t−s] · m_s[b, t]

Math is in fp32 (float64 inputs stay float64, for tests), the output rounded once to x's dtype;
out and dx in x's dtype, dweight in weight's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _tap(t: torch.Tensor, position_ids: torch.Tensor, s: int) -> torch.Tensor:
    """t[b, t−s] · m_s[b, t] ([B, T, C]): t delayed by s rows, zero where the tap is masked."""
    if s == 0:
        return t
    shifted = F.pad(t, (0, 0, s, 0))[:, :t.shape[1]]
    return torch.where((position_ids >= s).unsqueeze(-1), shifted, 0.0)


def _conv(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """a [B, T, C] in the compute dtype."""
    width, ct = weight.shape[-1], _compute_dtype(x)
    xf, w = x.to(ct), weight.to(ct).squeeze(1)  # [C, W]
    out = xf * w[:, width - 1]
    for s in range(1, width):
        out = out + _tap(xf, position_ids, s) * w[:, width - 1 - s]
    return out


def causal_conv_forward(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                        silu: bool = False) -> torch.Tensor:
    """out [B, T, C] in x's dtype; differentiable (torch autograd)."""
    out = _conv(x, weight, position_ids)
    return (F.silu(out) if silu else out).to(x.dtype)


def causal_conv_backward(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                         grad_out: torch.Tensor, silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C], dweight [C, 1, W]) from the formulas above, in the compute dtype; what the
    Triton backward implements."""
    width, ct = weight.shape[-1], _compute_dtype(x)
    xf, g, w = x.to(ct), grad_out.to(ct), weight.to(ct).squeeze(1)
    if silu:
        a = _conv(x, weight, position_ids)
        sig = torch.sigmoid(a)
        g = g * sig * (1 + a * (1 - sig))
    dx, dw = torch.zeros_like(g), torch.empty_like(w)
    for s in range(width):
        gm = g if s == 0 else torch.where((position_ids >= s).unsqueeze(-1), g, 0.0)  # g[t] · m_s[t]
        dx += w[:, width - 1 - s] * F.pad(gm, (0, 0, 0, s))[:, s:]  # gm[t+s], zero past the end
        dw[:, width - 1 - s] = (g * _tap(xf, position_ids, s)).sum((0, 1))
    return dx, dw.unsqueeze(1)
