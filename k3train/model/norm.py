"""RMSNorm with fp32 statistics: y = x / sqrt(mean(x²) + eps) · γ (``kernels.rms_norm``: fused Triton
kernels on CUDA, the torch reference elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role
from kernels.rms_norm import rms_norm

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    """``autocast_output``: under autocast, write y in the autocast dtype (for a norm whose every
    consumer is a GEMM that would cast it: the same values, no cast kernels, half the bytes)."""

    def __init__(self, dim: int, eps: float, autocast_output: bool = False):
        super().__init__()
        self.eps = eps
        self.autocast_output = autocast_output
        self.weight = set_role(nn.Parameter(torch.ones(dim)), ParamRole(Kind.NORM))

    def output_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of y for an input like ``x``."""
        device = x.device.type
        cast = self.autocast_output and torch.is_autocast_enabled(device)
        return torch.get_autocast_dtype(device) if cast else x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.output_dtype(x))
