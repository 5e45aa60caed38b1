"""Accumulating a low-precision gradient into its fp32 main gradient, in plain torch: the reference
of the Triton kernel and the CPU path.

For a main gradient m (fp32) and a parameter's gradient g (bf16 or fp16, same number of elements):

    first:  m ← float(g)            (exact: every bf16/fp16 value is an fp32 value)
    after:  m ← m + float(g)        (one fp32 rounding)
"""

from __future__ import annotations

import torch


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """main_grad (fp32) ← grad, or += grad; in place."""
    if first:
        main_grad.copy_(grad.view_as(main_grad))
    else:
        main_grad.add_(grad.view_as(main_grad))
