"""The grouped weight gradient in plain torch: the reference of the Triton kernel.

For rows grouped by expert (rows offsets[e-1]:offsets[e] belong to expert e, offsets [E] cumulative)
and a grouped linear layer y_m = x_m W_eᵀ with W [E, O, C], the weight gradient from g = ∂L/∂y [M, O]
and x [M, C] is

    dW[e] = Σ_{m ∈ rows of e} g_mᵀ x_m = G_eᵀ X_e        [E, O, C]   (zero for an expert without rows)
"""

from __future__ import annotations

import torch


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """g [M, O], x [M, C], offsets [E] → dW [E, O, C] in g.dtype, one GEMM per expert (fp32 accumulation)."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([g[s:e].float().t() @ x[s:e].float() for s, e in zip(starts, ends)]).to(g.dtype)


def grouped_wgrad_aten(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same product as autograd forms it for ``torch._grouped_mm`` (the K-grouped GEMM xᵀ g, read
    transposed, then laid out as W is): the path the kernel replaces, and the one off sm_90+."""
    return torch._grouped_mm(x.t(), g, offs=offsets).transpose(-2, -1).contiguous()
