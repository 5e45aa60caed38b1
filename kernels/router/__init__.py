"""The MoE sigmoid router's tail (sigmoid, bias, top-(k+1), renormalised weights, cutoff) as one
fused op (math in ``reference.py``)::

    weights, experts, scores, cutoff = route(logits, bias, top_k, scaling)
    # logits [N, E] fp32 (the router GEMM's output), bias [E] fp32
    # → weights [N, k] fp32 (differentiable), experts [N, k] int64, scores [N, E] fp32, cutoff [N] fp32

Only ``weights`` carries a gradient (to the logits); experts, scores and cutoff are detached.

``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernels of ``triton_router.py``: one launch forward, one backward (dense
  dlogits); saves the experts and the scores. Eagerly an autograd.Function that launches them
  directly; under ``torch.compile`` the same kernels as ``torch.library`` custom ops
  (``k3::route``, ``k3::route_backward``; ``backend.eager_or_compiled``): inductor lowers the
  reference's top-k to ``aten.topk``, a radix select and a sort of ~60 µs a call at bench-1B's
  8192 × 128. On CPU through Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before
  triton is imported. The
  selection order on exact ties of the biased scores is the lowest expert id first (``torch.topk``
  does not specify one); with fp32 scores of real logits ties are rare, and either choice is valid;
* ``"torch"``: ``reference.route``, differentiated by torch autograd (about eight kernels forward
  and eight backward on the GPU: what the kernels replace).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["route"]


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, scaling):
        from .triton_router import route_forward
        weights, experts, scores, cutoff = route_forward(logits, bias, top_k, scaling)
        ctx.mark_non_differentiable(experts, scores, cutoff)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the three outputs without one
        ctx.save_for_backward(experts, scores)
        ctx.scaling = scaling
        return weights, experts, scores, cutoff

    @staticmethod
    @once_differentiable
    def backward(ctx, dweights, dexperts, dscores, dcutoff):
        from .triton_router import route_backward
        if dweights is None:
            return None, None, None, None
        experts, scores = ctx.saved_tensors
        return route_backward(dweights, experts, scores, ctx.scaling), None, None, None


# Under torch.compile: the same kernels as custom ops.
@torch.library.custom_op("k3::route", mutates_args=())
def _route_op(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton_router import route_forward
    return route_forward(logits, bias, top_k, scaling)


@_route_op.register_fake
def _route_op_fake(logits, bias, top_k, scaling):
    m, e = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (torch.empty(m, top_k, **f32), torch.empty(m, top_k, dtype=torch.int64, device=logits.device),
            torch.empty(m, e, **f32), torch.empty(m, **f32))


@torch.library.custom_op("k3::route_backward", mutates_args=())
def _route_backward_op(dweights: torch.Tensor, experts: torch.Tensor, scores: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    from .triton_router import route_backward
    return route_backward(dweights, experts, scores, scaling)


@_route_backward_op.register_fake
def _route_backward_op_fake(dweights, experts, scores, scaling):
    return torch.empty_like(scores)


def _route_setup(ctx, inputs, output):
    ctx.scaling = inputs[3]
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _route_grad(ctx, dweights, dexperts, dscores, dcutoff):
    experts, scores = ctx.saved_tensors
    return _route_backward_op(dweights, experts, scores, ctx.scaling), None, None, None


_route_op.register_autograd(_route_grad, setup_context=_route_setup)

_route = eager_or_compiled(_Route.apply, _route_op)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
          backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid scores of ``logits`` [N, E], the ``top_k`` experts of scores + ``bias`` [E], their
    renormalised weights times ``scaling``, and the (k+1)-th biased score: (weights, experts, scores,
    cutoff)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, E], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if bias.shape != (num_experts,):
        raise ValueError(f"bias {tuple(bias.shape)} must be [E] = ({num_experts},) for logits {tuple(logits.shape)}")
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"logits and bias must be float32, got {logits.dtype} and {bias.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k < num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in (0, num_experts={num_experts})")
    if logits.device != bias.device:
        raise ValueError(f"logits on {logits.device} and bias on {bias.device} must share a device")
    if use_triton(logits, backend, "router") and logits.shape[0] > 0:
        return _route(logits, bias, top_k, float(scaling))
    return reference.route(logits, bias, top_k, scaling)
