"""The weight gradient of a grouped linear layer (the routed experts' W13 and W2; math in ``reference.py``)::

    grouped_wgrad(g, x, offsets)   # g [M, O], x [M, C], offsets [E] int32 cumulative → dW [E, O, C]
    grouped_wgrad_pair(g1, x1, g2, x2, offsets)   # two over the same groups, in one launch on Triton

``backend``:

* ``"auto"``: ``"triton"`` for bf16/fp16 CUDA tensors on sm_90 and newer (the kernel reads through TMA
  descriptors), ``"torch"`` otherwise;
* ``"triton"``: ``triton_grouped_wgrad.py``, one program per (expert, output tile), largest experts first.
  ``torch._grouped_mm``'s K-grouped GEMM (both operands MN-major), which autograd uses for this product,
  ran at about 175 TFLOP/s in the compiled bench-1B step: 14.1 ms a micro-batch against this kernel's 8.15
  (``docs/moe_notes.md``). Under ``torch.compile`` through the custom ops ``k3::grouped_wgrad`` and
  ``k3::grouped_wgrad_pair``; on CPU
  through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported), in fp32 too;
* ``"torch"``: ``reference.grouped_wgrad_aten``, what autograd computes for ``torch._grouped_mm``.

Both read rows whose pitch is a multiple of 16 bytes (TMA's and ``torch._grouped_mm``'s requirement).
"""

from __future__ import annotations

import torch

from ..backend import BACKENDS, eager_or_compiled, triton_device
from . import reference

__all__ = ["grouped_wgrad", "grouped_wgrad_pair"]


def _triton(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from .triton_grouped_wgrad import grouped_wgrad as kernel
    return kernel(g, x, offsets)


@torch.library.custom_op("k3::grouped_wgrad", mutates_args=())
def _grouped_wgrad_op(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _triton(g, x, offsets)


@_grouped_wgrad_op.register_fake
def _(g, x, offsets):
    return g.new_empty(offsets.shape[0], g.shape[1], x.shape[1])


_grouped_wgrad = eager_or_compiled(_triton, _grouped_wgrad_op)


def _triton_pair(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                 offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_grouped_wgrad import grouped_wgrad_pair as kernel
    return kernel(g1, x1, g2, x2, offsets)


@torch.library.custom_op("k3::grouped_wgrad_pair", mutates_args=())
def _grouped_wgrad_pair_op(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor,
                           offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_pair(g1, x1, g2, x2, offsets)


@_grouped_wgrad_pair_op.register_fake
def _(g1, x1, g2, x2, offsets):
    E = offsets.shape[0]
    return g1.new_empty(E, g1.shape[1], x1.shape[1]), g2.new_empty(E, g2.shape[1], x2.shape[1])


_grouped_wgrad_pair = eager_or_compiled(_triton_pair, _grouped_wgrad_pair_op)


def _use_triton(g: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped_wgrad backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch":
        return False
    if g.is_cuda:
        fits = g.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(g.device) >= (9, 0)
        if backend == "triton" and not fits:
            raise ValueError(f"the Triton grouped_wgrad kernel takes bf16/fp16 on sm_90+, got {g.dtype} on "
                             f"sm_{''.join(map(str, torch.cuda.get_device_capability(g.device)))}")
    else:
        fits = backend == "triton" or triton_device(g)
    return fits


def _check(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> None:
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0]:
        raise ValueError(f"g and x must be [M, O] and [M, C] with the same M, got {tuple(g.shape)} and "
                         f"{tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be int32 [E], got {offsets.dtype} {tuple(offsets.shape)}")
    if g.dtype != x.dtype:
        raise ValueError(f"g and x must share a dtype, got {g.dtype} and {x.dtype}")
    if any(t.shape[1] * t.element_size() % 16 for t in (g, x)):
        raise ValueError(f"rows of g and x must be multiples of 16 bytes, got {g.shape[1]} and {x.shape[1]} "
                         f"elements of {g.element_size()} bytes")


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """dW[e] = g[rows of e]ᵀ x[rows of e]: g [M, O], x [M, C], offsets [E] int32 → [E, O, C] in g.dtype."""
    _check(g, x, offsets)
    if not _use_triton(g, backend):
        return reference.grouped_wgrad_aten(g, x, offsets)
    return _grouped_wgrad(g.contiguous(), x.contiguous(), offsets)


def grouped_wgrad_pair(g1: torch.Tensor, x1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, offsets: torch.Tensor,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(``grouped_wgrad``(g1, x1, offsets), ``grouped_wgrad``(g2, x2, offsets)) for two layers over the same groups
    (the experts' W13 and W2): on the Triton backend one launch, one by-size order for both."""
    _check(g1, x1, offsets)
    _check(g2, x2, offsets)
    if g1.shape[0] != g2.shape[0] or g1.dtype != g2.dtype:
        raise ValueError(f"the two products must share rows and dtype, got g1 {tuple(g1.shape)} {g1.dtype} and g2 "
                         f"{tuple(g2.shape)} {g2.dtype}")
    if not _use_triton(g1, backend):
        return reference.grouped_wgrad_aten(g1, x1, offsets), reference.grouped_wgrad_aten(g2, x2, offsets)
    return _grouped_wgrad_pair(g1.contiguous(), x1.contiguous(), g2.contiguous(), x2.contiguous(), offsets)
