"""SiTU-GLU (K3 report Eq. 12) as a fused elementwise op with its own backward.

SiTU(a, c) = [β·tanh(a/β)·σ(a)] ⊙ [β_lin·tanh(c/β_lin)], computed in fp32, returned in the
input dtype (math and gradients in ``reference.py``)::

    y = situ_glu(gate, up)          # gate, up: [..., I] → y: [..., I]
    y = situ_glu_packed(gate_up)    # gate_up: [..., 2I] (gate first, then up) → y: [..., I]

``situ_glu_packed``'s backward returns one [..., 2I] gradient, written by the kernel
directly (no cat). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_situ.py`` (bf16, fp16, fp32), one launch forward
  and one backward, saving only the inputs; on CPU through Triton's interpreter, which
  needs ``TRITON_INTERPRET=1`` before triton is imported;
* ``"torch"``: ``reference.situ_forward``, differentiated by torch autograd.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..backend import use_triton
from . import reference

__all__ = ["situ_glu", "situ_glu_packed"]



def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [M, n]: a view when the leading dims merge and the last is contiguous."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        from .triton_situ import situ_forward as fwd
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta, linear_beta)
        return fwd(_rows(gate), _rows(up), beta, linear_beta).view(gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        from .triton_situ import situ_backward as bwd
        gate, up = ctx.saved_tensors
        dgate, dup = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (gate, up))
        bwd(_rows(gate), _rows(up), _rows(grad_out), _rows(dgate), _rows(dup), *ctx.betas)
        return dgate, dup, None, None


class _SiTUGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, beta, linear_beta):
        from .triton_situ import situ_forward as fwd
        ctx.save_for_backward(gate_up)
        ctx.betas = (beta, linear_beta)
        gu, i = _rows(gate_up), gate_up.shape[-1] // 2
        return fwd(gu[:, :i], gu[:, i:], beta, linear_beta).view(*gate_up.shape[:-1], i)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        from .triton_situ import situ_backward as bwd
        (gate_up,) = ctx.saved_tensors
        gu, i = _rows(gate_up), gate_up.shape[-1] // 2
        d = torch.empty(gu.shape, dtype=gate_up.dtype, device=gate_up.device)
        bwd(gu[:, :i], gu[:, i:], _rows(grad_out), d[:, :i], d[:, i:], *ctx.betas)
        return d.view(gate_up.shape), None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
             backend: str = "auto") -> torch.Tensor:
    """SiTU(gate, up) for gate, up [..., I] of one shape and dtype → [..., I] in gate.dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and dtype")
    if use_triton(gate, backend, "SiTU"):
        return _SiTUGLU.apply(gate, up, float(beta), float(linear_beta))
    return reference.situ_forward(gate, up, beta, linear_beta)


def situ_glu_packed(gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                    backend: str = "auto") -> torch.Tensor:
    """SiTU of gate_up [..., 2I] = [gate | up] along the last dim → [..., I]."""
    if gate_up.ndim == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up needs an even last dim, got shape {tuple(gate_up.shape)}")
    if use_triton(gate_up, backend, "SiTU"):
        return _SiTUGLUPacked.apply(gate_up, float(beta), float(linear_beta))
    i = gate_up.shape[-1] // 2
    return reference.situ_forward(gate_up[..., :i], gate_up[..., i:], beta, linear_beta)
