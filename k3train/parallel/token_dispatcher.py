"""Token dispatcher seam of the MoE layer (SEAMS.md §1): dispatch → grouped expert GEMMs → combine.

The MoE layer calls, whatever the implementation:

    x_grouped, tokens_per_expert, handle = dispatcher.dispatch(z, experts)
    y_grouped = routed_experts(x_grouped, tokens_per_expert)
    u = dispatcher.combine(y_grouped, weights, handle)

with z [N, ℓ] latent tokens, experts/weights [N, k] (chosen ids, gate weights), x_grouped/y_grouped
[M, ℓ] token copies sorted by expert (M = N·k locally) and tokens_per_expert [E_local] int64 on
the device. Nothing here waits on the host: shapes depend on N and k only.

``LocalTokenDispatcher`` (expert parallel size 1) permutes by index through
``kernels.moe_permute``: fused Triton gathers/scatters on CUDA, the torch reference elsewhere.
Both permutations have gather-only backwards (no atomics), so the layer is deterministic on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe_permute import combine_rows, dispatch_rows


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo ``dispatch``: ``order[m]`` is the token copy (i·k + j) at
    grouped row m, ``inverse`` its inverse permutation."""

    order: torch.Tensor  # [N·k] int64
    inverse: torch.Tensor  # [N·k] int64
    top_k: int


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
        return dispatch_rows(z, order, inverse, k), tokens_per_expert, DispatchHandle(order, inverse, k)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [N·k, ℓ] grouped, weights [N, k] → u [N, ℓ], u_i = Σ_j weights_ij · y_(i,j)."""
        return combine_rows(y, weights, handle.order, handle.inverse)
