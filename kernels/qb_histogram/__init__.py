"""Quantile Balancing's per-micro-batch histogram update as one fused op (math in ``reference.py``)::

    histogram_add(counts, scores, cutoff, lo, width)
    # counts [E, B] int32 (added into), scores [N, E] fp32, cutoff [N] fp32, lo / width 0-d fp32

``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise;
* ``"triton"``: the kernel of ``triton_qb_histogram.py``, one launch with integer atomics (the
  counts do not depend on scheduling). Under ``torch.compile`` through the custom op
  ``k3::qb_histogram_add`` (``backend.eager_or_compiled``): inductor's fusion of the reference still
  ends in aten's scatter-add, 0.125 ms a call in the compiled bench-1B step against the kernel's 0.062
  ([32768, 128] scores, 1000 bins, one H200; ``benchmarks/README.md``). On CPU through Triton's
  interpreter, which needs ``TRITON_INTERPRET=1`` before triton is imported;
* ``"torch"``: ``reference.histogram_add`` (about eight kernels on the GPU: the subtractions, the
  division, floor, cast, clamp, a ones tensor and the scatter-add; what the kernel replaces).
"""

from __future__ import annotations

import torch

from ..backend import eager_or_compiled, use_triton
from . import reference

__all__ = ["histogram_add"]


def _triton(counts, scores, cutoff, lo, width):
    from .triton_qb_histogram import histogram_add as kernel
    kernel(counts, scores, cutoff, lo, width)


@torch.library.custom_op("k3::qb_histogram_add", mutates_args=("counts",))
def _histogram_add_op(counts: torch.Tensor, scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor,
                      width: torch.Tensor) -> None:
    _triton(counts, scores, cutoff, lo, width)


@_histogram_add_op.register_fake
def _(counts, scores, cutoff, lo, width) -> None:
    return None


_histogram_add = eager_or_compiled(_triton, _histogram_add_op)


def histogram_add(counts: torch.Tensor, scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor,
                  width: torch.Tensor, backend: str = "auto") -> None:
    """counts[e, clamp(⌊(cutoff_i − scores_ie − lo) / width⌋, 0, B − 1)] += 1 for every token i and expert e."""
    if scores.dim() != 2 or cutoff.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [N, E] and cutoff [N], got {tuple(scores.shape)} and {tuple(cutoff.shape)}")
    if counts.dim() != 2 or counts.shape[0] != scores.shape[1] or counts.dtype != torch.int32:
        raise ValueError(f"counts must be int32 [E, B] with E = {scores.shape[1]}, got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    if scores.dtype != torch.float32 or cutoff.dtype != torch.float32:
        raise ValueError(f"scores and cutoff must be float32, got {scores.dtype} and {cutoff.dtype}")
    if lo.numel() != 1 or width.numel() != 1:
        raise ValueError(f"lo and width must be one-element tensors, got shapes {tuple(lo.shape)} and "
                         f"{tuple(width.shape)}")
    if use_triton(scores, backend, "QB histogram"):
        if not counts.is_contiguous():
            raise ValueError("the Triton QB histogram adds into contiguous counts")
        _histogram_add(counts, scores if scores.stride(1) == 1 else scores.contiguous(), cutoff.contiguous(),
                       lo.float(), width.float())
        return
    reference.histogram_add(counts, scores, cutoff, lo, width)
