"""Block AttnRes aggregation (K3_SPEC.md §2.1) as one fused op with its own backward.

    out = attn_res_aggregate(sources, query, gain)   # S × [..., d], w (d elements), γ [d] → [..., d]

out = Σ_i softmax_i((w ⊙ γ) · v_i / rms(v_i)) · v_i in fp32, returned in the sources' dtype (math
and gradients in ``reference.py``). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise; with more than
  ``MAX_SOURCES`` sources it falls back to ``"torch"`` and warns;
* ``"triton"``: the kernels of ``triton_attn_res.py``: one launch forward, one backward, sources
  read in place (no stack); saves the sources (alive anyway as bank rows), the per-token r_i and
  a_i ([..., S] fp32), and q̃ = w ⊙ γ; the gradients of w and γ follow from dq̃ by torch autograd.
  Eagerly an autograd.Function that launches the kernels directly; under ``torch.compile`` a
  ``torch.library`` custom op (``k3::attn_res``, its backward ``k3::attn_res_backward``) with fake
  shapes, so that inductor keeps it inside its graphs (``backend.eager_or_compiled``). On CPU through Triton's
  interpreter (``TRITON_INTERPRET=1`` before triton is imported);
* ``"torch"``: ``reference.attn_res_forward``, differentiated by torch autograd.
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference
from .triton_attn_res import MAX_SOURCES

__all__ = ["MAX_SOURCES", "attn_res_aggregate"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a contiguous [M, d] (a view when x is contiguous, else a copy)."""
    return x.contiguous().view(-1, x.shape[-1])


class _AttnResAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qt, *sources):
        from .triton_attn_res import attn_res_fwd
        rows = [_rows(v) for v in sources]
        out, r, a = attn_res_fwd(rows, qt)
        ctx.save_for_backward(qt, r, a, *sources)
        return out.view(sources[0].shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        from .triton_attn_res import attn_res_bwd
        qt, r, a, *sources = ctx.saved_tensors
        dvs, dqt = attn_res_bwd([_rows(v) for v in sources], qt, _rows(grad_out), r, a)
        return (dqt, *(dv.view(v.shape) for dv, v in zip(dvs, sources)))


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::attn_res", mutates_args=())
def _attn_res(qt: torch.Tensor, sources: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton forward: (out [..., d] in the sources' dtype, r and a [M, S] fp32 for backward)."""
    from .triton_attn_res import attn_res_fwd
    out, r, a = attn_res_fwd([_rows(v) for v in sources], qt)
    return out.view(sources[0].shape), r, a


@_attn_res.register_fake
def _attn_res_fake(qt, sources):
    v0 = sources[0]
    rows = (v0.numel() // v0.shape[-1], len(sources))
    return v0.new_empty(v0.shape), qt.new_empty(rows), qt.new_empty(rows)


@torch.library.custom_op("k3::attn_res_backward", mutates_args=())
def _attn_res_backward(sources: list[torch.Tensor], qt: torch.Tensor, grad_out: torch.Tensor, r: torch.Tensor,
                       a: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from .triton_attn_res import attn_res_bwd
    dvs, dqt = attn_res_bwd([_rows(v) for v in sources], qt, _rows(grad_out), r, a)
    return dqt, [dv.view(v.shape) for dv, v in zip(dvs, sources)]


@_attn_res_backward.register_fake
def _attn_res_backward_fake(sources, qt, grad_out, r, a):
    return torch.empty_like(qt), [v.new_empty(v.shape) for v in sources]


def _setup_context(ctx, inputs, output):
    qt, sources = inputs
    _, r, a = output
    ctx.save_for_backward(qt, r, a, *sources)


def _backward(ctx, grad_out, _grad_r, _grad_a):
    qt, r, a, *sources = ctx.saved_tensors
    return _attn_res_backward(sources, qt, grad_out.contiguous(), r, a)


_attn_res.register_autograd(_backward, setup_context=_setup_context)

_aggregate = eager_or_compiled(lambda qt, sources: _AttnResAggregate.apply(qt, *sources),
                               lambda qt, sources: _attn_res(qt, sources)[0])


def attn_res_aggregate(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                       backend: str = "auto") -> torch.Tensor:
    """Softmax-over-depth mix of ``sources`` (S tensors [..., d] of one shape, dtype and device)
    with pseudo-query ``query`` (d elements, e.g. [1, d]) and gain ``gain`` [d] → [..., d]."""
    v0 = sources[0]
    if any(v.shape != v0.shape or v.dtype != v0.dtype or v.device != v0.device for v in sources):
        raise ValueError("AttnRes sources need one shape, dtype and device, got "
                         f"{[(tuple(v.shape), v.dtype, str(v.device)) for v in sources]}")
    if use_triton(v0, backend, "AttnRes"):
        if len(sources) > MAX_SOURCES:
            if backend == "triton":
                raise ValueError(f"the Triton AttnRes kernels take at most {MAX_SOURCES} sources, "
                                 f"got {len(sources)}")
            warnings.warn(f"AttnRes with {len(sources)} > {MAX_SOURCES} sources: using the torch "
                          "reference (stacked, slower)", stacklevel=2)
        else:
            qt = (query.float().view(-1) * gain.float()).contiguous()
            return _aggregate(qt, list(sources))
    return reference.attn_res_forward(sources, query, gain)
