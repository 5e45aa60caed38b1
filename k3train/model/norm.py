"""RMSNorm with fp32 statistics: y = x / sqrt(mean(x²) + eps) · γ."""

from __future__ import annotations

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` in fp32 and scale by ``weight``; returns ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = set_role(nn.Parameter(torch.ones(dim)), ParamRole(Kind.NORM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
