"""RMSNorm with fp32 statistics as one fused op: y = x / √(mean(x²) + eps) · w (math in
``reference.py``)::

    y = rms_norm(x, weight, eps)                   # x [..., n], weight [n] → y [..., n] in x.dtype
    y = rms_norm(x, weight, eps, torch.bfloat16)   # y stored in bf16 (x and dx stay in x.dtype)

An ``out_dtype`` below x's saves the cast that a bf16 consumer (an autocast GEMM) would make: same
values (one rounding of the fp32 result), half the bytes written.

``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_rms_norm.py`` (bf16, fp16, fp32 inputs; any float weight):
  one launch forward, one backward plus the sum of its per-program weight-gradient partials;
  saves x, the weight and r [M] fp32. Eagerly an autograd.Function that launches them directly;
  under ``torch.compile`` ``torch.library`` custom ops (``k3::rms_norm``, ``k3::rms_norm_backward``)
  with fake shapes (``backend.eager_or_compiled``). On CPU through Triton's interpreter, which
  needs ``TRITON_INTERPRET=1`` before triton is imported;
* ``"torch"``: ``reference.rms_norm``, differentiated by torch autograd (eight elementwise and
  reduction ops forward, about twenty backward: what the kernels replace on the GPU).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["rms_norm"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [M, n]: a view when the leading dims merge and the last is contiguous."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        from .triton_rms_norm import rms_norm_forward
        x2 = _rows(x)
        y, r = rms_norm_forward(x2, weight, eps, out_dtype)
        ctx.save_for_backward(x2, weight, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        from .triton_rms_norm import rms_norm_backward
        x2, weight, r = ctx.saved_tensors
        dx, dw = rms_norm_backward(x2, weight, r, _rows(dy))
        return dx.view(ctx.shape), dw, None, None


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., n] in out_dtype, r [M] fp32) of the Triton forward."""
    from .triton_rms_norm import rms_norm_forward
    y, r = rms_norm_forward(_rows(x), weight, eps, out_dtype)
    return y.view(x.shape), r


@_rms_norm_op.register_fake
def _rms_norm_op_fake(x, weight, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("k3::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor, dy: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_rms_norm import rms_norm_backward
    dx, dw = rms_norm_backward(_rows(x), weight, r, _rows(dy))
    return dx.view(x.shape), dw


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_op_fake(x, weight, r, dy):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, dy, dr):
    x, weight, r = ctx.saved_tensors
    return *_rms_norm_backward_op(x, weight, r, dy), None, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _compiled(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    return _rms_norm_op(x, weight, eps, out_dtype)[0]


_norm = eager_or_compiled(_RMSNorm.apply, _compiled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             backend: str = "auto") -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` [..., n] in fp32 and scale by ``weight`` [n]; out in
    ``out_dtype`` (default x.dtype)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} must match the last dim of x {tuple(x.shape)}")
    out_dtype = out_dtype or x.dtype
    if use_triton(x, backend, "RMSNorm") and x.numel() > 0:
        return _norm(x, weight, float(eps), out_dtype)
    return reference.rms_norm(x, weight, eps, out_dtype)
