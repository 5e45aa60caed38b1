"""Block AttnRes aggregation (K3_SPEC.md §2.1) as one fused op with its own backward, optionally
with the RMSNorm that reads the mix fused in.

    x = attn_res_aggregate(sources, query, gain)                       # S × [..., d], w, γ [d] → [..., d]
    y = attn_res_rms_norm(sources, query, gain, weight, eps, out_dtype)   # RMSNorm(x)·weight
    y, passed = attn_res_site(sources, query, gain, weight, eps, out_dtype, pass_through=n)
    y, passed = attn_res_site(sources, …, pass_through=n, residual=b)   # last source: sources[-1] + b

x = Σ_i softmax_i((w ⊙ γ) · v_i / rms(v_i)) · v_i in fp32, returned in the sources' dtype (math and
gradients in ``reference.py``); y = x/√(mean(x²) + eps) ⊙ weight in fp32, stored in ``out_dtype``
(``kernels.rms_norm``'s math). ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise; with more than
  ``MAX_SOURCES`` sources it falls back to ``"torch"`` and warns;
* ``"triton"``: the kernels of ``triton_attn_res.py``: one launch forward, one backward, sources
  read in place (no stack); saves the sources (alive anyway as bank rows), the per-token r_i and
  a_i ([..., S] fp32), and q̃ = w ⊙ γ; the gradients of w and γ follow from dq̃ by torch autograd.
  With the norm, x is never stored: the forward writes y alone and the backward rebuilds x from
  the sources it reads anyway, so a site moves two fewer fp32 [..., d] tensors each way.
  ``attn_res_site`` also returns its last n sources as outputs of the op ("passed"): whoever reads
  a source after this site reads the passed one, so the gradient of those reads comes into this
  site's backward kernel, which adds it to its own (read once) instead of autograd adding the two
  fp32 [..., d] gradients in a kernel of its own (read twice, written once).
  An autograd.Function that launches the kernels directly; under ``torch.compile`` it calls them as
  ``torch.library`` custom ops (``k3::attn_res``, ``k3::attn_res_backward``) with fake shapes, so that
  inductor keeps them inside its graphs. On CPU through Triton's interpreter (``TRITON_INTERPRET=1``
  before triton is imported);
* ``"torch"``: ``reference.attn_res_forward`` (then ``kernels.rms_norm``'s torch path),
  differentiated by torch autograd.
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd.function import once_differentiable

from ..backend import use_triton
from ..rms_norm import rms_norm
from . import reference
from .triton_attn_res import MAX_SOURCES

__all__ = ["MAX_SOURCES", "attn_res_aggregate", "attn_res_rms_norm", "attn_res_site"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a contiguous [M, d] (a view when x is contiguous, else a copy)."""
    return x.contiguous().view(-1, x.shape[-1])


def _kernel_forward(qt, sources, norm_weight, norm_eps, out_dtype, residual):
    """The Triton forward: (x or y [..., d], r and a [M, S] fp32 for backward, the last source with
    ``residual`` added or None)."""
    from .triton_attn_res import attn_res_fwd
    out, r, a, last = attn_res_fwd([_rows(v) for v in sources], qt, norm_weight, norm_eps, out_dtype,
                                   None if residual is None else _rows(residual))
    shape = sources[0].shape
    return out.view(shape), r, a, None if last is None else last.view(shape)


def _kernel_backward(sources, qt, grad_out, r, a, norm_weight, norm_eps, grad_in, residual_dtype):
    """The Triton backward: (dq̃, the norm weight's gradient or None, dv_i + grad_in_i, the residual's
    gradient or None)."""
    from .triton_attn_res import attn_res_bwd
    dvs, dqt, dnw, dres = attn_res_bwd([_rows(v) for v in sources], qt, _rows(grad_out), r, a, norm_weight, norm_eps,
                                       [None if g is None else _rows(g) for g in grad_in], residual_dtype)
    shape = sources[0].shape
    return dqt, dnw, [dv.view(shape) for dv in dvs], None if dres is None else dres.view(shape)


class _AttnRes(torch.autograd.Function):
    """(q̃, norm weight or None, norm eps, out dtype or None, pass_through, residual or None, *sources) →
    (x or y, *the last ``pass_through`` sources). Those come back as outputs of this op, so the
    gradients later readers send them arrive in its backward, which adds each into its own dv_i in the
    kernel; autograd has nothing left to sum for them. With a residual the last source is
    sources[-1] + residual, formed in the kernel; it is the last one passed on, and its gradient is
    both sources[-1]'s and the residual's. Eagerly it launches the kernels directly; while dynamo
    traces it (into the graph) it calls them as the custom ops below."""

    @staticmethod
    def forward(ctx, qt, norm_weight, norm_eps, out_dtype, pass_through, residual, *sources):
        forward = _attn_res if torch.compiler.is_compiling() else _kernel_forward
        out, r, a, last = forward(qt, list(sources), norm_weight, norm_eps, out_dtype, residual)
        if residual is not None:
            sources = (*sources[:-1], last)
        ctx.save_for_backward(qt, norm_weight, r, a, *sources)
        ctx.norm_eps, ctx.pass_through = norm_eps, pass_through
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.set_materialize_grads(False)  # a passed source nobody reads brings no gradient: nothing to add
        return (out, *sources[len(sources) - pass_through:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *grad_passed):
        qt, norm_weight, r, a, *sources = ctx.saved_tensors
        grad_out = torch.zeros_like(sources[0]) if grad_out is None else grad_out.contiguous()
        grad_in = [None] * (len(sources) - ctx.pass_through) + [
            None if g is None else g.contiguous() for g in grad_passed]
        if torch.compiler.is_compiling():
            dqt, dnw, dvs, dres = _attn_res_backward(sources, qt, grad_out, r, a, norm_weight, ctx.norm_eps, grad_in,
                                                     ctx.residual_dtype)
            dnw = None if norm_weight is None else dnw
            dres = None if ctx.residual_dtype is None else dres
        else:
            dqt, dnw, dvs, dres = _kernel_backward(sources, qt, grad_out, r, a, norm_weight, ctx.norm_eps, grad_in,
                                                   ctx.residual_dtype)
        return (dqt, dnw, None, None, None, dres, *dvs)


# Under torch.compile: the kernels as custom ops (autograd is _AttnRes's). A custom op returns tensors: an
# absent norm-weight gradient, last source or residual gradient is an empty one.
@torch.library.custom_op("k3::attn_res", mutates_args=())
def _attn_res(qt: torch.Tensor, sources: list[torch.Tensor], norm_weight: torch.Tensor | None, norm_eps: float,
              out_dtype: torch.dtype | None, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, r, a, last = _kernel_forward(qt, sources, norm_weight, norm_eps, out_dtype, residual)
    return out, r, a, qt.new_empty(0) if last is None else last


@_attn_res.register_fake
def _attn_res_fake(qt, sources, norm_weight, norm_eps, out_dtype, residual):
    v0 = sources[0]
    rows = (v0.numel() // v0.shape[-1], len(sources))
    last = qt.new_empty(0) if residual is None else v0.new_empty(v0.shape)
    return v0.new_empty(v0.shape, dtype=out_dtype or v0.dtype), qt.new_empty(rows), qt.new_empty(rows), last


@torch.library.custom_op("k3::attn_res_backward", mutates_args=())
def _attn_res_backward(sources: list[torch.Tensor], qt: torch.Tensor, grad_out: torch.Tensor, r: torch.Tensor,
                       a: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float,
                       grad_in: list[torch.Tensor | None], residual_dtype: torch.dtype | None
                       ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    dqt, dnw, dvs, dres = _kernel_backward(sources, qt, grad_out, r, a, norm_weight, norm_eps, grad_in,
                                           residual_dtype)
    return dqt, qt.new_empty(0) if dnw is None else dnw, dvs, qt.new_empty(0) if dres is None else dres


@_attn_res_backward.register_fake
def _attn_res_backward_fake(sources, qt, grad_out, r, a, norm_weight, norm_eps, grad_in, residual_dtype):
    dnw = qt.new_empty(0) if norm_weight is None else torch.empty_like(norm_weight)
    v0 = sources[0]
    dres = qt.new_empty(0) if residual_dtype is None else v0.new_empty(v0.shape, dtype=residual_dtype)
    return torch.empty_like(qt), dnw, [v.new_empty(v.shape) for v in sources], dres


def _triton_sources(sources: list[torch.Tensor], backend: str) -> bool:
    """Checks the sources; whether the Triton kernels take them."""
    v0 = sources[0]
    if any(v.shape != v0.shape or v.dtype != v0.dtype or v.device != v0.device for v in sources):
        raise ValueError("AttnRes sources need one shape, dtype and device, got "
                         f"{[(tuple(v.shape), v.dtype, str(v.device)) for v in sources]}")
    if not use_triton(v0, backend, "AttnRes"):
        return False
    if len(sources) <= MAX_SOURCES:
        return True
    if backend == "triton":
        raise ValueError(f"the Triton AttnRes kernels take at most {MAX_SOURCES} sources, got {len(sources)}")
    warnings.warn(f"AttnRes with {len(sources)} > {MAX_SOURCES} sources: using the torch "
                  "reference (stacked, slower)", stacklevel=3)
    return False


def _query(query: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """q̃ = w ⊙ γ, fp32 [d]."""
    return (query.float().view(-1) * gain.float()).contiguous()


def attn_res_aggregate(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                       backend: str = "auto") -> torch.Tensor:
    """Softmax-over-depth mix of ``sources`` (S tensors [..., d] of one shape, dtype and device)
    with pseudo-query ``query`` (d elements, e.g. [1, d]) and gain ``gain`` [d] → [..., d]."""
    if _triton_sources(sources, backend):
        return _AttnRes.apply(_query(query, gain), None, 0.0, None, 0, None, *sources)[0]
    return reference.attn_res_forward(sources, query, gain)


def attn_res_rms_norm(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                      norm_weight: torch.Tensor, norm_eps: float, out_dtype: torch.dtype | None = None,
                      backend: str = "auto") -> torch.Tensor:
    """``rms_norm(attn_res_aggregate(sources, query, gain), norm_weight, norm_eps, out_dtype)`` [..., d]
    in ``out_dtype`` (default the sources' dtype); on the Triton path, one kernel each way."""
    return attn_res_site(sources, query, gain, norm_weight, norm_eps, out_dtype, 0, backend)[0]


def attn_res_site(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                  norm_weight: torch.Tensor, norm_eps: float, out_dtype: torch.dtype | None = None,
                  pass_through: int = 0, backend: str = "auto", residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(``attn_res_rms_norm(sources, …)``, the last ``pass_through`` sources passed through the op).

    The passed sources hold the same values; a caller reads them instead of the originals from here on.
    On the Triton path the gradients those later reads produce then enter this site's backward, which
    adds them into its own source gradients in the kernel, so autograd sums nothing for them (the torch
    path returns the originals, and autograd sums as usual).

    ``residual`` (of the sources' shape, any float dtype): the last source is sources[-1] + residual,
    in the sources' dtype (a residual-stream add, e.g. P + Attn(x)); passed on, it is the sum that is
    passed in place of sources[-1]. The row kernels form the sum as they read, and write its gradient for the
    residual as they write sources[-1]'s: one pass fewer over the rows each way than a separate add."""
    d = sources[0].shape[-1]
    if norm_weight.shape != (d,):
        raise ValueError(f"the norm weight {tuple(norm_weight.shape)} must be [{d}], the sources' last dim")
    if not 0 <= pass_through <= len(sources):
        raise ValueError(f"pass_through={pass_through}: pass 0..{len(sources)} of the {len(sources)} sources")
    if residual is not None and residual.shape != sources[-1].shape:
        raise ValueError(f"the residual {tuple(residual.shape)} must have the sources' shape "
                         f"{tuple(sources[-1].shape)}")
    if _triton_sources(sources, backend):
        out, *passed = _AttnRes.apply(_query(query, gain), norm_weight, float(norm_eps), out_dtype, pass_through,
                                      residual, *sources)
        return out, passed
    if residual is not None:
        sources = [*sources[:-1], (sources[-1] + residual).to(sources[-1].dtype)]
    out = rms_norm(reference.attn_res_forward(sources, query, gain), norm_weight, norm_eps, out_dtype,
                   backend=backend)
    return out, list(sources[len(sources) - pass_through:])
