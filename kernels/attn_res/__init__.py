"""Block AttnRes aggregation (K3_SPEC.md §2.1) as one fused op with its own backward.

    out = attn_res_aggregate(sources, query, gain)   # S × [..., d], w (d elements), γ [d] → [..., d]

out = Σ_i softmax_i((w ⊙ γ) · v_i / rms(v_i)) · v_i in fp32, returned in the sources' dtype (math
and gradients in ``reference.py``). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise; with more than
  ``MAX_SOURCES`` sources it falls back to ``"torch"`` and warns;
* ``"triton"``: the kernels of ``triton_attn_res.py``: one launch forward, one backward, sources
  read in place (no stack); saves the sources (alive anyway as bank rows), the per-token r_i and
  a_i ([..., S] fp32), and q̃ = w ⊙ γ; the gradients of w and γ follow from dq̃ by torch autograd.
  On CPU through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported);
* ``"torch"``: ``reference.attn_res_forward``, differentiated by torch autograd.
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd.function import once_differentiable

from ..backend import use_triton
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
            return _AttnResAggregate.apply(qt, *sources)
    return reference.attn_res_forward(sources, query, gain)
