"""SiTU-GLU feed-forward (K3 report Eq. 12), used by the dense layer and the shared experts.

SiTU(a, c) = [β·tanh(a/β)·σ(a)] ⊙ [β_lin·tanh(c/β_lin)], β = 4, β_lin = 25, in fp32.
|SiTU| ≤ β·β_lin, and it equals SwiGLU (silu(a)·c) to first order at 0.
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.parallel.tensor_parallel import TPSpec
from kernels import situ


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of gate and up projections, computed in fp32, returned in ``gate.dtype``
    (one fused Triton kernel each way on CUDA, ``kernels/situ``)."""
    return situ.situ_glu(gate, up, beta, linear_beta)


class SiTUMLP(nn.Module):
    """y = W_down · SiTU(W_gate x, W_up x); gate/up column-parallel, down row-parallel.

    x: [..., d] → y: [..., d], hidden width ``intermediate`` (sharded over TP).
    """

    def __init__(self, tp: TPSpec, hidden: int, intermediate: int, beta: float, linear_beta: float):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = tp.column(hidden, intermediate, what="FFN intermediate size")
        self.up_proj = tp.column(hidden, intermediate, what="FFN intermediate size")
        self.down_proj = tp.row(intermediate, hidden, what="FFN intermediate size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
