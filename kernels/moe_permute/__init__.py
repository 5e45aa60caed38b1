"""MoE token permutation as fused gather/scatter ops with their own backwards.

With N tokens, k choices a token, ``order`` a permutation of range(N·k) (grouped row m holds
token copy order[m] = i·k + j, token i's j-th choice) and ``inverse`` its inverse permutation
(inverse[order[m]] = m); math in ``reference.py``::

    x = dispatch_rows(z, order, inverse, top_k)    # z [N, ℓ] → x [N·k, ℓ], x[m] = z[order[m] // k]
    x, xw = dispatch_weighted_rows(z, w, order, inverse, top_k)  # and xw [N·k], xw[m] = w.flatten()[order[m]]
    u = combine_rows(y, weights, order, inverse)   # y [N·k, ℓ], weights [N, k] → u [N, ℓ],
                                                   # u[i] = Σ_j weights[i, j] · y[inverse[i·k + j]]

A padded grouped layout (``pad_rows``: P grouped rows that hold no token copy, as the expert-tiled GEMMs want;
``inverse`` then maps into N·k + P rows) is written with zeros in those rows by dispatch, and combine neither
reads them nor gives them a gradient other than 0.

Sums (over the k copies, and over ℓ for dweights) are taken in fp32; outputs and gradients come
in their input's dtype (u and dy in y's, dz in z's, dweights in weights'). ``order`` and
``inverse`` are int32 or int64 on the tensors' device; both backwards are gathers, or scatters
that write every row once, so nothing uses atomics and results are deterministic. ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_permute.py`` (bf16, fp16, fp32), one launch forward and
  one backward each, reading only ``inverse``; dispatch saves only ``inverse``, combine ``inverse``
  plus y (if weights need a gradient) and weights (if y needs one). Eagerly autograd.Functions
  that launch them directly; under ``torch.compile`` ``torch.library`` custom ops
  (``k3::moe_dispatch_rows``, ``k3::moe_combine_rows``, with fake shapes and their backwards as
  ops; combine saves y and weights), so that inductor keeps them in its graphs
  (``backend.eager_or_compiled``). On CPU through Triton's interpreter, which needs
  ``TRITON_INTERPRET=1`` before triton is imported;
* ``"torch"``: ``reference.dispatch_rows`` / ``reference.combine_rows``, differentiated by torch
  autograd.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["dispatch_rows", "dispatch_weighted_rows", "combine_rows"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_indices(order: torch.Tensor, inverse: torch.Tensor, m: int, device: torch.device) -> None:
    for name, t in (("order", order), ("inverse", inverse)):
        if t.shape != (m,) or t.dtype not in _INDEX_DTYPES or t.device != device:
            raise ValueError(f"{name} must be an int32/int64 [{m}] tensor on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, ℓ] with a contiguous last dim (row strides stay free)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, inverse, top_k, pad_rows, weights):
        from .triton_permute import dispatch_forward
        ctx.save_for_backward(inverse)
        ctx.top_k, ctx.dtypes = top_k, (z.dtype, None if weights is None else weights.dtype)
        x, xw = dispatch_forward(z, inverse, top_k, pad_rows, weights)
        if xw is None:
            xw = z.new_empty(0)
            ctx.mark_non_differentiable(xw)
        return x, xw

    @staticmethod
    @once_differentiable
    def backward(ctx, dx, dxw):
        from .triton_permute import dispatch_backward
        (inverse,) = ctx.saved_tensors
        z_dtype, w_dtype = ctx.dtypes
        dz, dw = dispatch_backward(_rows(dx), inverse, ctx.top_k, z_dtype, None if w_dtype is None else dxw.contiguous(),
                                   w_dtype)
        return dz, None, None, None, dw


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, inverse, pad_rows):
        from .triton_permute import combine_forward
        need_dy, need_dw = ctx.needs_input_grad[:2]
        ctx.save_for_backward(y if need_dw else None, weights if need_dy else None, inverse, pad_rows)
        ctx.top_k, ctx.dtypes = weights.shape[1], (y.dtype, weights.dtype)
        return combine_forward(y, weights, inverse)

    @staticmethod
    @once_differentiable
    def backward(ctx, du):
        from .triton_permute import combine_backward
        y, weights, inverse, pad_rows = ctx.saved_tensors
        dy, dw = combine_backward(_rows(du), y, weights, inverse, ctx.top_k, *ctx.dtypes, pad_rows)
        return dy, dw, None, None


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::moe_dispatch_rows", mutates_args=())
def _dispatch(z: torch.Tensor, inverse: torch.Tensor, top_k: int, pad_rows: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, xw); xw is empty without ``weights``."""
    from .triton_permute import dispatch_forward
    x, xw = dispatch_forward(z, inverse, top_k, pad_rows, weights)
    return x, z.new_empty(0) if xw is None else xw


@_dispatch.register_fake
def _dispatch_fake(z, inverse, top_k, pad_rows=None, weights=None):
    rows = z.shape[0] * top_k + (0 if pad_rows is None else pad_rows.shape[0])
    return z.new_empty(rows, z.shape[1]), z.new_empty(0) if weights is None else weights.new_empty(rows)


@torch.library.custom_op("k3::moe_dispatch_rows_backward", mutates_args=())
def _dispatch_backward(dx: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype,
                       d_row_weights: torch.Tensor | None = None, w_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, dweights); dweights is empty without ``d_row_weights``."""
    from .triton_permute import dispatch_backward
    dz, dw = dispatch_backward(_rows(dx), inverse, top_k, dtype, d_row_weights, w_dtype)
    return dz, dx.new_empty(0) if dw is None else dw


@_dispatch_backward.register_fake
def _dispatch_backward_fake(dx, inverse, top_k, dtype, d_row_weights=None, w_dtype=None):
    n = inverse.shape[0] // top_k  # dx may hold padding rows
    dw = dx.new_empty(0) if d_row_weights is None else dx.new_empty(n, top_k, dtype=w_dtype)
    return dx.new_empty(n, dx.shape[1], dtype=dtype), dw


def _dispatch_setup(ctx, inputs, output):
    z, inverse, ctx.top_k, _, weights = inputs
    ctx.dtypes = z.dtype, None if weights is None else weights.dtype
    ctx.save_for_backward(inverse)


def _dispatch_grad(ctx, dx, dxw):
    (inverse,) = ctx.saved_tensors
    z_dtype, w_dtype = ctx.dtypes
    if w_dtype is None:
        return _dispatch_backward(dx, inverse, ctx.top_k, z_dtype)[0], None, None, None, None
    dz, dw = _dispatch_backward(dx, inverse, ctx.top_k, z_dtype, dxw.contiguous(), w_dtype)
    return dz, None, None, None, dw


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


@torch.library.custom_op("k3::moe_combine_rows", mutates_args=())
def _combine(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, pad_rows: torch.Tensor | None = None
             ) -> torch.Tensor:
    from .triton_permute import combine_forward
    return combine_forward(y, weights, inverse)


@_combine.register_fake
def _combine_fake(y, weights, inverse, pad_rows=None):
    return y.new_empty(weights.shape[0], y.shape[1])


@torch.library.custom_op("k3::moe_combine_rows_backward", mutates_args=())
def _combine_backward(du: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor,
                      pad_rows: torch.Tensor | None = None, need_dweights: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dweights); without ``need_dweights`` (weights that need no gradient: rows weighted before the
    combine) y is not read and dweights is empty."""
    from .triton_permute import combine_backward
    dy, dw = combine_backward(_rows(du), y if need_dweights else None, weights, inverse, weights.shape[1], y.dtype,
                              weights.dtype, pad_rows)
    return dy, weights.new_empty(0) if dw is None else dw


@_combine_backward.register_fake
def _combine_backward_fake(du, y, weights, inverse, pad_rows=None, need_dweights=True):
    return y.new_empty(y.shape), weights.new_empty(weights.shape if need_dweights else (0,))


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_grad(ctx, du):
    y, weights, inverse, pad_rows = ctx.saved_tensors
    need_dweights = ctx.needs_input_grad[1]
    dy, dw = _combine_backward(du, y, weights, inverse, pad_rows, need_dweights)
    return dy, dw if need_dweights else None, None, None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)

_dispatch_call = eager_or_compiled(_DispatchRows.apply, _dispatch)
_combine_call = eager_or_compiled(_CombineRows.apply, _combine)


def _check_padding(pad_rows: torch.Tensor | None, device: torch.device) -> None:
    if pad_rows is not None and (pad_rows.ndim != 1 or pad_rows.dtype not in _INDEX_DTYPES or
                                 pad_rows.device != device):
        raise ValueError(f"pad_rows must be an int32/int64 1-D tensor on {device}, got {tuple(pad_rows.shape)} "
                         f"{pad_rows.dtype} on {pad_rows.device}")


def _check_dispatch(z: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int,
                    pad_rows: torch.Tensor | None) -> None:
    if z.ndim != 2 or top_k < 1:
        raise ValueError(f"z must be [N, ℓ] and top_k ≥ 1, got {tuple(z.shape)} and {top_k}")
    _check_indices(order, inverse, z.shape[0] * top_k, z.device)
    _check_padding(pad_rows, z.device)


def dispatch_rows(z: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int,
                  backend: str = "auto", pad_rows: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, ℓ] → x [N·k + P, ℓ] in z.dtype, x[m] = z[order[m] // top_k]; dz sums the k copies.

    ``pad_rows`` [P] (default none): rows of a padded grouped layout that hold no token copy, written as
    zeros; ``inverse`` then maps into the N·k + P rows (``order`` is not used for padded layouts)."""
    _check_dispatch(z, order, inverse, top_k, pad_rows)
    if use_triton(z, backend, "MoE permute"):
        return _dispatch_call(_rows(z), inverse.contiguous(), int(top_k), pad_rows, None)[0]
    return reference.dispatch_rows(z, order, inverse, top_k, pad_rows)


def dispatch_weighted_rows(z: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                           top_k: int, backend: str = "auto", pad_rows: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``dispatch_rows``(z, …), xw): also each grouped row's gate weight, xw [N·k + P] in weights' dtype with
    xw[m] = weights.flatten()[order[m]] and 0 on the padding rows, from weights [N, k]; dweights gathers xw's
    gradient back. The Triton path makes both in one launch forward and one backward (the rows' launches)."""
    _check_dispatch(z, order, inverse, top_k, pad_rows)
    if weights.shape != (z.shape[0], top_k) or not weights.is_floating_point() or weights.device != z.device:
        raise ValueError(f"weights must be a floating [{z.shape[0]}, {top_k}] tensor on {z.device}, got "
                         f"{weights.dtype} {tuple(weights.shape)} on {weights.device}")
    if use_triton(z, backend, "MoE permute"):
        return _dispatch_call(_rows(z), inverse.contiguous(), int(top_k), pad_rows, weights.contiguous())
    return (reference.dispatch_rows(z, order, inverse, top_k, pad_rows),
            reference.dispatch_rows(weights.reshape(-1, 1), order, inverse, 1, pad_rows).squeeze(1))


def combine_rows(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                 backend: str = "auto", pad_rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [N·k + P, ℓ] (grouped rows), weights [N, k] (fp32 or y.dtype) → u [N, ℓ] in y.dtype,
    u[i] = Σ_j weights[i, j] · y[inverse[i·k + j]]; the P rows ``pad_rows`` (as ``dispatch_rows``) are not
    read and get zero gradients."""
    pad = 0 if pad_rows is None else pad_rows.numel()
    if y.ndim != 2 or weights.ndim != 2 or y.shape[0] != weights.numel() + pad:
        raise ValueError(f"y must be [N·k{f' + {pad}' if pad else ''}, ℓ] for weights [N, k], got {tuple(y.shape)} and "
                         f"{tuple(weights.shape)}")
    if weights.dtype not in (torch.float32, y.dtype) or weights.device != y.device:
        raise ValueError(f"weights must be fp32 or y's dtype {y.dtype} on {y.device}, got "
                         f"{weights.dtype} on {weights.device}")
    _check_indices(order, inverse, weights.numel(), y.device)
    _check_padding(pad_rows, y.device)
    if use_triton(y, backend, "MoE permute"):
        return _combine_call(_rows(y), weights.contiguous(), inverse.contiguous(), pad_rows)
    return reference.combine_rows(y, weights, order, inverse)
