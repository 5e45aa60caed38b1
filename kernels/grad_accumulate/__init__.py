"""Accumulating a parameter's bf16/fp16 gradient into its fp32 main gradient (math in ``reference.py``)::

    accumulate(main_grad, grad, first)   # main_grad fp32, grad of the same numel; first: copy, else add

Called once per parameter and backward by ``k3train.parallel.grad_buffers`` (mixed precision with
bf16 parameters). ``backend``: ``"auto"`` is ``"triton"`` for CUDA tensors that are both contiguous,
``"torch"`` otherwise (the reference; its bf16 → fp32 ``copy_`` is an unvectorized cast kernel on CUDA).
"""

from __future__ import annotations

import torch

from ..backend import use_triton
from . import reference

__all__ = ["accumulate"]


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor, first: bool, backend: str = "auto") -> None:
    """main_grad ← grad (first) or main_grad + grad, in fp32, in place."""
    if main_grad.dtype != torch.float32:
        raise ValueError(f"main_grad must be float32, got {main_grad.dtype}")
    if main_grad.numel() != grad.numel() or main_grad.device != grad.device:
        raise ValueError(f"main_grad {tuple(main_grad.shape)} on {main_grad.device} and grad {tuple(grad.shape)} "
                         f"on {grad.device} must hold as many elements on one device")
    if (use_triton(grad, backend, "grad_accumulate") and main_grad.is_contiguous() and grad.is_contiguous()
            and grad.numel() > 0):
        from .triton_grad_accumulate import accumulate as triton_accumulate
        triton_accumulate(main_grad, grad, first)
        return
    reference.accumulate(main_grad, grad, first)
