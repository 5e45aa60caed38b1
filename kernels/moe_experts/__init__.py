"""The routed experts from the latent tokens to the grouped outputs, with the gather and SiTU fused into
the grouped GEMMs (math in ``reference.py``)::

    y = routed_experts_fused(z, order, inverse, top_k, offsets, w13, w2, beta, linear_beta)
    # z [N, ℓ], order/inverse [N·k] (a dispatch's sort), offsets [E] cumulative rows,
    # w13 [E, 2I, ℓ], w2 [E, ℓ, I] → y [N·k, ℓ] grouped rows, ready for the weighted combine

What runs (``triton_moe_experts.py`` for the two fused kernels, ``torch._grouped_mm`` for the rest):

* forward: gate|up = W13 · z[token] with the rows read from z by index, SiTU in the epilogue (writes
  gu and h, no gathered copy of z and no separate SiTU pass); y = grouped W2 · h;
* backward: dgu = SiTU'(gu) ⊙ (dy · W2) with the SiTU backward in the GEMM's epilogue (dh never stored);
  dW2 = dyᵀ h and dW13 = dguᵀ x per expert (x gathered again here, by the dispatch kernel); dz = the
  sum over each token's k rows of dgu · W13 (the dispatch backward).

Against the unfused path (``LocalTokenDispatcher.dispatch`` → ``RoutedExperts.forward``) this saves the
forward gather's copy of the rows and both SiTU passes' round trips of gu and h. Saves z, w13, w2,
order, inverse, offsets, gu and h. CUDA (bf16 dots), or CPU through Triton's interpreter (fp32 dots);
not a ``torch.library`` op (eager only). Measured on one H200 (session 13) it was slower than the unfused
grouped path (1.54 against 1.30 ms fwd+bwd at bench-1B dims, tuned): its two Triton GEMMs ran 2-4x the bare
``torch._grouped_mm`` of their products, bound by registers (``docs/moe_notes.md`` §2). The kernels now
take the weights (and the backward its rows) through TMA descriptors and run their SiTU epilogues on
quarter tiles, which takes them from 196-255 registers to 79-198 and lets the wide tiles compile without
spills; not yet timed. It stays a benchmark row (``benchmarks/moe.py --impls fused``) until it wins.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["routed_experts_fused"]


def _grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


class _RoutedExpertsFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, w13, w2, order, inverse, offsets, top_k, beta, linear_beta):
        from .triton_moe_experts import w13_situ_forward
        gu, h = w13_situ_forward(z, order, offsets, w13, top_k, beta, linear_beta)
        y = _grouped(h, w2.transpose(-2, -1), offsets)
        ctx.save_for_backward(z, w13, w2, order, inverse, offsets, gu, h)
        ctx.top_k, ctx.betas = top_k, (beta, linear_beta)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        from ..moe_permute.triton_permute import dispatch_backward, dispatch_forward
        from .triton_moe_experts import w2_dgrad_situ_backward
        z, w13, w2, order, inverse, offsets, gu, h = ctx.saved_tensors
        dy = dy.contiguous()
        dgu = w2_dgrad_situ_backward(dy, w2, gu, offsets, *ctx.betas)
        dw2 = _grouped(dy.t(), h, offsets)  # [E, ℓ, I]: per expert dyᵀ h
        x = dispatch_forward(z, inverse, ctx.top_k)
        dw13 = _grouped(dgu.t(), x, offsets)  # [E, 2I, ℓ]
        dz = dispatch_backward(_grouped(dgu, w13, offsets), inverse, ctx.top_k, z.dtype)
        return dz, dw13.to(w13.dtype), dw2.to(w2.dtype), None, None, None, None, None, None


def routed_experts_fused(z: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int,
                         offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, beta: float,
                         linear_beta: float) -> torch.Tensor:
    """Grouped expert outputs y [N·k, ℓ] (module docstring); z, w13 and w2 in one dtype, contiguous z."""
    if not (z.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"z, w13 and w2 must share a dtype, got {z.dtype}, {w13.dtype}, {w2.dtype}")
    if z.ndim != 2 or w13.shape[2] != z.shape[1] or w2.shape[1] != z.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"expected z [N, ℓ], w13 [E, 2I, ℓ], w2 [E, ℓ, I]; got {tuple(z.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    if order.shape != (z.shape[0] * top_k,) or offsets.shape != (w13.shape[0],):
        raise ValueError(f"order must be [N·k] = [{z.shape[0] * top_k}] and offsets [E] = [{w13.shape[0]}], got "
                         f"{tuple(order.shape)}, {tuple(offsets.shape)}")
    return _RoutedExpertsFused.apply(z.contiguous(), w13, w2, order, inverse, offsets, top_k, beta, linear_beta)
