"""RMSNorm with fp32 statistics as one fused op: y = x / √(mean(x²) + eps) · w (math in
``reference.py``)::

    y = rms_norm(x, weight, eps)                   # x [..., n], weight [n] → y [..., n] in x.dtype
    y = rms_norm(x, weight, eps, torch.bfloat16)   # y stored in bf16 (x and dx stay in x.dtype)
    y = rms_norm(x, weight, eps, gate=g)           # gated: y = RMSNorm(x)·w·σ(g), g [..., n] logits

An ``out_dtype`` below x's saves the cast that a bf16 consumer (an autocast GEMM) would make: same
values (one rounding of the fp32 result), half the bytes written. The gate is applied to the fp32
normalised value before the one rounding to ``out_dtype``.

``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_rms_norm.py`` (bf16, fp16, fp32 inputs; any float weight):
  one launch forward, one backward plus the sum of its per-program weight-gradient partials;
  saves x, the weight, the gate and r [M] fp32. Eagerly an autograd.Function that launches them directly;
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


def _gate_rows(gate: torch.Tensor | None) -> torch.Tensor | None:
    return None if gate is None else _rows(gate)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps, out_dtype):
        from .triton_rms_norm import rms_norm_forward
        x2, g2 = _rows(x), _gate_rows(gate)
        y, r = rms_norm_forward(x2, weight, g2, eps, out_dtype)
        ctx.save_for_backward(x2, weight, g2, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        from .triton_rms_norm import rms_norm_backward
        x2, weight, g2, r = ctx.saved_tensors
        dx, dw, dg = rms_norm_backward(x2, weight, g2, r, _rows(dy))
        return dx.view(ctx.shape), dw, None if dg is None else dg.view(ctx.shape), None, None


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., n] in out_dtype, r [M] fp32) of the Triton forward."""
    from .triton_rms_norm import rms_norm_forward
    y, r = rms_norm_forward(_rows(x), weight, _gate_rows(gate), eps, out_dtype)
    return y.view(x.shape), r


@_rms_norm_op.register_fake
def _rms_norm_op_fake(x, weight, gate, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("k3::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, r: torch.Tensor,
                          dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, dgate); dgate is empty without a gate (a custom op returns tensors, not None)."""
    from .triton_rms_norm import rms_norm_backward
    dx, dw, dg = rms_norm_backward(_rows(x), weight, _gate_rows(gate), r, _rows(dy))
    return dx.view(x.shape), dw, x.new_empty(0) if dg is None else dg.view(x.shape)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_op_fake(x, weight, gate, r, dy):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty(0) if gate is None else gate.new_empty(gate.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, gate, _, _ = inputs
    ctx.gated = gate is not None
    ctx.save_for_backward(x, weight, gate, output[1])


def _rms_norm_grad(ctx, dy, dr):
    x, weight, gate, r = ctx.saved_tensors
    dx, dw, dg = _rms_norm_backward_op(x, weight, gate, r, dy)
    return dx, dw, dg if ctx.gated else None, None, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _compiled(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    return _rms_norm_op(x, weight, gate, eps, out_dtype)[0]


_norm = eager_or_compiled(_RMSNorm.apply, _compiled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             gate: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` [..., n] in fp32 and scale by ``weight`` [n] (and by σ(gate),
    gate [..., n] logits); out in ``out_dtype`` (default x.dtype)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} must match the last dim of x {tuple(x.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have the shape of x {tuple(x.shape)}")
    out_dtype = out_dtype or x.dtype
    if use_triton(x, backend, "RMSNorm") and x.numel() > 0:
        return _norm(x, weight, gate, float(eps), out_dtype)
    return reference.rms_norm(x, weight, eps, out_dtype, gate)
