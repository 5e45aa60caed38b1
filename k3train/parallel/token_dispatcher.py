"""Token dispatcher seam of the MoE layer (SEAMS.md §1): dispatch → grouped expert GEMMs → combine.

The MoE layer calls, whatever the implementation:

    x_grouped, tokens_per_expert, handle = dispatcher.dispatch(z, experts)
    y_grouped = routed_experts(x_grouped, tokens_per_expert)
    u = dispatcher.combine(y_grouped, weights, handle)

with z [N, ℓ] latent tokens, experts/weights [N, k] (chosen ids, gate weights), x_grouped/y_grouped
[M, ℓ] token copies sorted by expert (M = N·k locally) and tokens_per_expert [E_local] int64 on
the device. Nothing here waits on the host: shapes depend on N and k only.

``LocalTokenDispatcher`` (expert parallel size 1) permutes by index. Both permutations have
gather-only backwards (no atomics), so the layer is deterministic on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo ``dispatch``: ``order[m]`` is the token copy (i·k + j) at
    grouped row m, ``inverse`` its inverse permutation."""

    order: torch.Tensor  # [N·k] int64
    inverse: torch.Tensor  # [N·k] int64
    top_k: int


class _DispatchRows(torch.autograd.Function):
    """out[m] = z[order[m] // k]; dz[i] = Σ_j dout[inverse[i·k + j]]."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return z.index_select(0, order.div(top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        return g.view(-1, ctx.top_k, g.shape[-1]).sum(1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """out = x[perm] for a permutation ``perm``; dx = dout[perm_inverse]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, perm_inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(perm_inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (perm_inverse,) = ctx.saved_tensors
        return grad.index_select(0, perm_inverse), None, None


class LocalTokenDispatcher:
    """All experts on this rank: sort token copies by expert, then weight and sum them back."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, z: torch.Tensor, experts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """z [N, ℓ], experts [N, k] → grouped rows [N·k, ℓ], tokens per expert [E], handle."""
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        tokens_per_expert = torch.bincount(flat, minlength=self.num_experts)
        k = experts.shape[1]
        return _DispatchRows.apply(z, order, inverse, k), tokens_per_expert, DispatchHandle(order, inverse, k)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [N·k, ℓ] grouped, weights [N, k] → u [N, ℓ], u_i = Σ_j weights_ij · y_(i,j)."""
        per_token = _PermuteRows.apply(y, handle.inverse, handle.order).view(-1, handle.top_k, y.shape[-1])
        return torch.bmm(weights.to(y.dtype).unsqueeze(1), per_token).squeeze(1)
