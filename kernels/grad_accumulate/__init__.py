"""Accumulating a parameter's bf16/fp16 gradient into its fp32 main gradient (math in ``reference.py``)::

    accumulate(main_grad, grad, first)   # main_grad fp32, grad of the same numel; first: copy, else add

Called once per parameter and backward by ``k3train.parallel.grad_buffers`` (mixed precision with
bf16 parameters). ``backend``: ``"auto"`` is ``"triton"`` for contiguous CUDA tensors of at least
``TRITON_MIN_NUMEL`` elements, ``"torch"`` otherwise (the reference; its bf16 → fp32 ``copy_`` is an
unvectorized cast kernel on CUDA). The size bar is for the host: a Triton launch from Python costs more
host time than torch's copy, and each runs from a backward hook. Of bench-1B's 352 trainable tensors,
the 82 with at least 2^20 elements hold 95.9% of the elements, so the bar keeps nearly all of the
kernel's GPU time saving for a quarter of the launches (the host times themselves are not measured).
"""

from __future__ import annotations

import torch

from ..backend import use_triton
from . import reference

__all__ = ["accumulate"]

TRITON_MIN_NUMEL = 1 << 20  # "auto": smaller gradients take torch's copy (see the module docstring)


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor, first: bool, backend: str = "auto") -> None:
    """main_grad ← grad (first) or main_grad + grad, in fp32, in place."""
    if main_grad.dtype != torch.float32:
        raise ValueError(f"main_grad must be float32, got {main_grad.dtype}")
    if main_grad.numel() != grad.numel() or main_grad.device != grad.device:
        raise ValueError(f"main_grad {tuple(main_grad.shape)} on {main_grad.device} and grad {tuple(grad.shape)} "
                         f"on {grad.device} must hold as many elements on one device")
    big_enough = backend == "triton" or grad.numel() >= TRITON_MIN_NUMEL
    if (use_triton(grad, backend, "grad_accumulate") and big_enough and main_grad.is_contiguous()
            and grad.is_contiguous() and grad.numel() > 0):
        from .triton_grad_accumulate import accumulate as triton_accumulate
        triton_accumulate(main_grad, grad, first)
        return
    reference.accumulate(main_grad, grad, first)
