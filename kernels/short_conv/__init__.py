"""KDA's depthwise causal short conv with document resets as one fused op with its own backward.

    out = causal_conv_with_resets(x, weight, position_ids)   # [B, T, C], [C, 1, W], [B, T] → [B, T, C]
    out = causal_conv_with_resets(x, weight, position_ids, silu=True)   # SiLU(conv), KDA's q/k/v

a[b, t] = Σ_s weight[:, 0, W−1−s] · x[b, t−s] · [position_ids[b, t] ≥ s] (t − s ≥ 0), in fp32; out
is a, or SiLU(a) with ``silu`` (fused: no separate activation pass forward or backward), rounded
once to x's dtype (math and gradients in ``reference.py``). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors with W ≤ ``MAX_TAPS``, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_short_conv.py`` (x bf16, fp16 or fp32, W ≤ 4), one launch
  forward and one backward, saving only x, the weight and position_ids; eagerly an
  autograd.Function that launches them directly, under ``torch.compile`` ``torch.library`` custom
  ops (``k3::short_conv`` and its backward) with fake shapes, so that inductor keeps them in its
  graphs (``backend.eager_or_compiled``); on CPU through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
  imported);
* ``"torch"``: ``reference.causal_conv_forward``, differentiated by torch autograd.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["causal_conv_with_resets", "MAX_TAPS"]

MAX_TAPS = 4  # the Triton backward's register window: the widest conv the kernels take


class _CausalConvWithResets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, position_ids, silu):
        from .triton_short_conv import short_conv_fwd
        x, pos = x.contiguous(), position_ids.contiguous()
        w = weight.float().reshape(weight.shape[0], weight.shape[-1]).contiguous()
        ctx.save_for_backward(x, w, pos)
        ctx.weight_shape, ctx.weight_dtype, ctx.silu = weight.shape, weight.dtype, silu
        return short_conv_fwd(x, w, pos, silu)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        from .triton_short_conv import short_conv_bwd
        x, w, pos = ctx.saved_tensors
        dx, dw = short_conv_bwd(x, w, pos, grad_out.contiguous(), ctx.silu)
        return dx, dw.view(ctx.weight_shape).to(ctx.weight_dtype), None, None


# Under torch.compile: the same kernels as custom ops (the weight's reshape and cast traced around them).
@torch.library.custom_op("k3::short_conv", mutates_args=())
def _short_conv(x: torch.Tensor, w: torch.Tensor, position_ids: torch.Tensor, silu: bool) -> torch.Tensor:
    """The Triton forward: x [B, T, C] contiguous, w fp32 [C, W] contiguous → out [B, T, C]."""
    from .triton_short_conv import short_conv_fwd
    return short_conv_fwd(x, w, position_ids, silu)


@_short_conv.register_fake
def _short_conv_fake(x, w, position_ids, silu):
    return torch.empty_like(x)


@torch.library.custom_op("k3::short_conv_backward", mutates_args=())
def _short_conv_backward(x: torch.Tensor, w: torch.Tensor, position_ids: torch.Tensor, grad_out: torch.Tensor,
                         silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_short_conv import short_conv_bwd
    return short_conv_bwd(x, w, position_ids, grad_out, silu)


@_short_conv_backward.register_fake
def _short_conv_backward_fake(x, w, position_ids, grad_out, silu):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.silu = inputs[3]


def _backward(ctx, grad_out):
    x, w, pos = ctx.saved_tensors
    dx, dw = _short_conv_backward(x, w, pos, grad_out.contiguous(), ctx.silu)
    return dx, dw, None, None


_short_conv.register_autograd(_backward, setup_context=_setup_context)


def _short_conv_compiled(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                         silu: bool) -> torch.Tensor:
    w = weight.float().reshape(weight.shape[0], weight.shape[-1]).contiguous()
    return _short_conv(x.contiguous(), w, position_ids.contiguous(), silu)


_conv = eager_or_compiled(_CausalConvWithResets.apply, _short_conv_compiled)


def causal_conv_with_resets(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor,
                            silu: bool = False, backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv, no bias, that never reads across a document start, then SiLU if ``silu``:
    x [B, T, C], weight [C, 1, W], position_ids [B, T] (0 where a document starts) → [B, T, C] in
    x's dtype."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[:2] != (x.shape[2], 1) \
            or position_ids.shape != x.shape[:2]:
        raise ValueError(f"short conv takes x [B, T, C], weight [C, 1, W], position_ids [B, T]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(position_ids.shape)}")
    width = weight.shape[-1]
    if backend == "triton" and width > MAX_TAPS:
        raise ValueError(f"the Triton short-conv kernels take up to {MAX_TAPS} taps, got a weight of {width}; "
                         f"use backend='torch' (or 'auto', which does for wider convs)")
    if use_triton(x, backend, "short-conv") and width <= MAX_TAPS:
        return _conv(x, weight, position_ids, bool(silu))
    return reference.causal_conv_forward(x, weight, position_ids, silu)
