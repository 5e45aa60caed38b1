"""The two memory-bound passes of a Muon step around Newton–Schulz, each one read of its inputs.

Every tensor is a [nb, R, C] view of one parameter's blocks in the parameter's orientation
(any strides: the NS stack holds tall blocks transposed, so ``out`` and ``update`` are
often transposed views into it).

``nesterov_into(grad, buf, out, momentum, nesterov)``, before NS::

    buf <- buf + (1 - mu) (grad - buf)                        (EMA momentum, in place, buf's dtype)
    out <- grad + mu (buf - grad)  if nesterov  else  buf     (cast to out.dtype: the bf16 NS input)

``apply_update(param, update, beta, alpha, sumsq)``, after NS::

    param <- beta param + alpha update                         (decoupled decay and the step)
    sumsq += sum(update^2)                                     (fp32; for the update-RMS metric)

Bytes per element with fp32 grad/momentum/param and a bf16 stack: 4 + 4 read, 4 + 2 written
before; 4 + 2 read, 4 written after (24 in all; the torch ops take 12 + 10 before and
8 + 10 + 2 after). ``backend``: "auto" (Triton for CUDA tensors, torch otherwise), "triton"
(on CPU through Triton's interpreter), "torch". The Triton sum of squares adds per-program
partials with atomics, so its last bits vary from run to run; the update itself does not.
"""

from __future__ import annotations

import torch

from kernels.backend import use_triton

__all__ = ["nesterov_into", "apply_update"]


def _check(name: str, *ts: torch.Tensor) -> None:
    shape = ts[0].shape
    if ts[0].ndim != 3 or any(t.shape != shape for t in ts):
        raise ValueError(f"{name}: expected [nb, R, C] views of one shape, got {[tuple(t.shape) for t in ts]}")


def nesterov_into(grad: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, momentum: float, nesterov: bool,
                  backend: str = "auto") -> None:
    """Update the momentum ``buf`` in place and write the NS input into ``out`` (module docstring)."""
    _check("nesterov_into", grad, buf, out)
    if use_triton(buf, backend, "Muon momentum"):
        from kernels.newton_schulz import triton_passes

        triton_passes.nesterov_into(grad, buf, out, momentum, nesterov)
        return
    g = grad.to(buf.dtype)
    buf.lerp_(g, 1.0 - momentum)
    if nesterov:
        torch.lerp(g, buf, momentum, out=out)
    else:
        out.copy_(buf)


def apply_update(param: torch.Tensor, update: torch.Tensor, beta: float | torch.Tensor, alpha: float | torch.Tensor,
                 sumsq: torch.Tensor, backend: str = "auto") -> None:
    """``param <- beta param + alpha update``; add sum(update^2) to the fp32 0-d ``sumsq``. ``beta`` and
    ``alpha`` are numbers, or (so that a step captured in a CUDA graph can change them) both 0-d fp32
    tensors on the parameter's device."""
    _check("apply_update", param, update)
    if use_triton(param, backend, "Muon update"):
        from kernels.newton_schulz import triton_passes

        triton_passes.apply_update(param, update, beta, alpha, sumsq)
        return
    if isinstance(beta, torch.Tensor):
        param.mul_(beta).addcmul_(update, alpha)
    else:
        if beta != 1.0:
            param.mul_(beta)
        param.add_(update, alpha=alpha)
    sumsq.add_(torch.linalg.vector_norm(update, dtype=torch.float32).square())
