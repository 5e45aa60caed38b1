"""SiTU-GLU (K3 report Eq. 12) as a fused elementwise op with its own backward.

SiTU(a, c) = [β·tanh(a/β)·σ(a)] ⊙ [β_lin·tanh(c/β_lin)], computed in fp32, returned in the
input dtype (math and gradients in ``reference.py``)::

    y = situ_glu(gate, up)                  # gate, up: [..., I] → y: [..., I]
    y = situ_glu_interleaved(gate_up)       # gate_up: [..., 2I], columns (gate_0, up_0, gate_1, up_1, ...)
    y = situ_glu_interleaved(gate_up, row_scale=s)  # s [...]: y = s · SiTU, row by row (ds = Σ_I dy · SiTU)

The interleaved form is what the routed experts' GEMM gives (``RoutedExperts.w13``'s rows are
(gate_j, up_j) pairs); its backward returns one [..., 2I] gradient in the same layout, written by
the kernel directly through column-strided views (no copy, no cat). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_situ.py`` (bf16, fp16, fp32), one launch forward
  and one backward, saving only the inputs; eagerly autograd.Functions that launch them
  directly, under ``torch.compile`` ``torch.library`` custom ops (``k3::situ_glu``,
  ``k3::situ_glu_interleaved`` and their backwards) with fake shapes, so that inductor keeps them in
  its graphs (``backend.eager_or_compiled``); on CPU through Triton's interpreter, which
  needs ``TRITON_INTERPRET=1`` before triton is imported;
* ``"torch"``: ``reference.situ_forward``, differentiated by torch autograd.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["situ_glu", "situ_glu_interleaved"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [M, n] with a contiguous last dim (what the kernels read: free row strides): a view when
    the leading dims merge and the last is contiguous."""
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


def _flat(row_scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if row_scale is None else row_scale.reshape(-1).contiguous()


def _pairs(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of interleaved rows gu [M, 2I]: the views gu[:, 0::2] and gu[:, 1::2], [M, I], which the kernels
    read (and write) as pairs."""
    return gu[:, 0::2], gu[:, 1::2]


def _interleaved_forward(gate_up, beta, linear_beta, row_scale):
    """SiTU of gate_up [..., 2I] (interleaved pairs) → contiguous [..., I], by the Triton forward."""
    from .triton_situ import situ_forward
    y = situ_forward(*_pairs(_rows(gate_up)), beta, linear_beta, _flat(row_scale))
    return y.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _interleaved_backward(gate_up, grad_out, beta, linear_beta, row_scale):
    """(d gate_up [..., 2I] interleaved like gate_up, d row_scale in its dtype or None), by the Triton backward."""
    from .triton_situ import situ_backward
    gu = _rows(gate_up)
    d = torch.empty(gu.shape, dtype=gate_up.dtype, device=gate_up.device)
    ds = situ_backward(*_pairs(gu), _rows(grad_out), *_pairs(d), beta, linear_beta, _flat(row_scale))
    return d.view(gate_up.shape), None if ds is None else ds.view(row_scale.shape).to(row_scale.dtype)


class _SiTUGLUInterleaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, beta, linear_beta, row_scale):
        ctx.save_for_backward(gate_up, row_scale)
        ctx.betas = (beta, linear_beta)
        return _interleaved_forward(gate_up, beta, linear_beta, row_scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        gate_up, row_scale = ctx.saved_tensors
        d, ds = _interleaved_backward(gate_up, grad_out, *ctx.betas, row_scale)
        return d, None, None, ds


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::situ_glu", mutates_args=())
def _situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """The Triton forward of SiTU(gate, up), gate and up [..., I] → [..., I] (contiguous)."""
    from .triton_situ import situ_forward
    return situ_forward(_rows(gate), _rows(up), beta, linear_beta).view(gate.shape)


@_situ_glu.register_fake
def _situ_glu_fake(gate, up, beta, linear_beta):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("k3::situ_glu_backward", mutates_args=())
def _situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, beta: float,
                       linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_situ import situ_backward
    dgate, dup = gate.new_empty(gate.shape), up.new_empty(up.shape)
    situ_backward(_rows(gate), _rows(up), _rows(grad_out), _rows(dgate), _rows(dup), beta, linear_beta)
    return dgate, dup


@_situ_glu_backward.register_fake
def _situ_glu_backward_fake(gate, up, grad_out, beta, linear_beta):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _situ_glu_setup(ctx, inputs, output):
    gate, up, ctx.beta, ctx.linear_beta = inputs
    ctx.save_for_backward(gate, up)


def _situ_glu_grad(ctx, grad_out):
    gate, up = ctx.saved_tensors
    return *_situ_glu_backward(gate, up, grad_out, ctx.beta, ctx.linear_beta), None, None


_situ_glu.register_autograd(_situ_glu_grad, setup_context=_situ_glu_setup)


@torch.library.custom_op("k3::situ_glu_interleaved", mutates_args=())
def _situ_glu_interleaved(gate_up: torch.Tensor, beta: float, linear_beta: float,
                          row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton forward of SiTU over gate_up [..., 2I] = (gate_0, up_0, gate_1, ...) → [..., I] (contiguous),
    each row times row_scale [...] if given."""
    return _interleaved_forward(gate_up, beta, linear_beta, row_scale)


@_situ_glu_interleaved.register_fake
def _situ_glu_interleaved_fake(gate_up, beta, linear_beta, row_scale=None):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("k3::situ_glu_interleaved_backward", mutates_args=())
def _situ_glu_interleaved_backward(gate_up: torch.Tensor, grad_out: torch.Tensor, beta: float, linear_beta: float,
                                   row_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One interleaved [..., 2I] gradient, both column sets written by the kernel, and row_scale's (empty
    without)."""
    d, ds = _interleaved_backward(gate_up, grad_out, beta, linear_beta, row_scale)
    return d, gate_up.new_empty(0) if ds is None else ds


@_situ_glu_interleaved_backward.register_fake
def _situ_glu_interleaved_backward_fake(gate_up, grad_out, beta, linear_beta, row_scale=None):
    return gate_up.new_empty(gate_up.shape), gate_up.new_empty(0) if row_scale is None else row_scale.new_empty(
        row_scale.shape)


def _situ_glu_interleaved_setup(ctx, inputs, output):
    gate_up, ctx.beta, ctx.linear_beta, row_scale = inputs
    ctx.save_for_backward(gate_up, row_scale)


def _situ_glu_interleaved_grad(ctx, grad_out):
    gate_up, row_scale = ctx.saved_tensors
    d, ds = _situ_glu_interleaved_backward(gate_up, grad_out, ctx.beta, ctx.linear_beta, row_scale)
    return d, None, None, None if row_scale is None else ds


_situ_glu_interleaved.register_autograd(_situ_glu_interleaved_grad, setup_context=_situ_glu_interleaved_setup)

_glu = eager_or_compiled(_SiTUGLU.apply, _situ_glu)
_glu_interleaved = eager_or_compiled(_SiTUGLUInterleaved.apply, _situ_glu_interleaved)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
             backend: str = "auto") -> torch.Tensor:
    """SiTU(gate, up) for gate, up [..., I] of one shape and dtype → [..., I] in gate.dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and dtype")
    if use_triton(gate, backend, "SiTU"):
        return _glu(gate, up, float(beta), float(linear_beta))
    return reference.situ_forward(gate, up, beta, linear_beta)


def situ_glu_interleaved(gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                         backend: str = "auto", row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., I], y_j = SiTU(gate_up[..., 2j], gate_up[..., 2j + 1]): SiTU of gate_up [..., 2I] whose columns
    interleave (gate_j, up_j); with ``row_scale`` [...] (differentiable; fp32 or gate_up's dtype) each output
    row times its scale, in the same fp32 pass. The gradient is one [..., 2I] tensor in gate_up's layout."""
    if gate_up.ndim == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up needs an even last dim of (gate, up) pairs, got shape {tuple(gate_up.shape)}")
    if row_scale is not None and (row_scale.shape != gate_up.shape[:-1] or row_scale.device != gate_up.device):
        raise ValueError(f"row_scale must be {tuple(gate_up.shape[:-1])} on {gate_up.device}, got "
                         f"{tuple(row_scale.shape)} on {row_scale.device}")
    if use_triton(gate_up, backend, "SiTU"):
        return _glu_interleaved(gate_up, float(beta), float(linear_beta), row_scale)
    return reference.situ_forward(gate_up[..., 0::2], gate_up[..., 1::2], beta, linear_beta, row_scale)
