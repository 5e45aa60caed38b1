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
``AllToAllTokenDispatcher`` (``parallel.expert`` > 1) adds the exchange of rows between the
expert-parallel ranks around it; ``token_dispatcher`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.moe_permute import combine_rows, dispatch_rows


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo ``dispatch``: ``order[m]`` is the token copy (i·k + j) at
    grouped row m, ``inverse`` its inverse permutation; ``tokens_per_expert`` counts this rank's
    token copies per expert (all E, for the load metrics)."""

    order: torch.Tensor  # [N·k] int64
    inverse: torch.Tensor  # [N·k] int64
    top_k: int
    tokens_per_expert: torch.Tensor  # [E] int64


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
        handle = DispatchHandle(order, inverse, k, tokens_per_expert)
        return dispatch_rows(z, order, inverse, k), tokens_per_expert, handle

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y [N·k, ℓ] grouped, weights [N, k] → u [N, ℓ], u_i = Σ_j weights_ij · y_(i,j)."""
        return combine_rows(y, weights, handle.order, handle.inverse)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over ``group``: send[splits_out[r] rows] → rank r; the backward sends the
    gradients back the same way (splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


@dataclass
class AllToAllHandle:
    """What ``AllToAllTokenDispatcher.combine`` needs: the local sort, the row counts sent to and
    received from each rank, and the (source rank, expert) → (expert, source rank) reordering."""

    local: DispatchHandle
    send_splits: list[int]
    recv_splits: list[int]
    to_expert_major: torch.Tensor  # [M_recv] int64: expert-major row m comes from received row [m]
    to_rank_major: torch.Tensor  # its inverse

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """This rank's token copies per expert, all E of them [E]."""
        return self.local.tokens_per_expert


class AllToAllTokenDispatcher:
    """Experts sharded over the expert-parallel group: rank r holds experts [r·E_l, (r+1)·E_l).

    dispatch: sort the N·k token copies by expert (which groups them by destination rank), swap
    the per-(rank, expert) counts, send the rows by all-to-all at the latent width ℓ, and reorder
    the received rows from (source rank, expert) to (expert, source rank) for the grouped GEMMs.
    combine: the same steps backwards, then the local weighted sum. Gradients flow back through
    both all-to-alls. The row counts are read on the host once per dispatch (the all-to-all needs
    its split sizes); a rank that receives no rows still takes part in every collective.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"model.num_experts={num_experts} is not divisible by parallel.expert={self.size}")
        self.num_experts, self.local_experts = num_experts, num_experts // self.size
        self.sort = LocalTokenDispatcher(num_experts)

    def dispatch(self, z: torch.Tensor, experts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        """z [N, ℓ], experts [N, k] (global ids) → rows of this rank's experts [M_recv, ℓ] sorted by
        local expert, tokens per local expert [E_l], handle."""
        rows, tokens_per_expert, local = self.sort.dispatch(z, experts)
        send_counts = tokens_per_expert.view(self.size, self.local_experts)  # [dest rank, its expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my expert]
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        received = _AllToAll.apply(rows, send_splits, recv_splits, self.group)
        block = torch.arange(recv_counts.numel(), device=z.device).repeat_interleave(
            recv_counts.flatten(), output_size=received.shape[0])  # source·E_l + expert of each row
        source, expert = block // self.local_experts, block % self.local_experts
        to_expert_major = (expert * self.size + source).argsort(stable=True)
        to_rank_major = torch.empty_like(to_expert_major)
        to_rank_major[to_expert_major] = torch.arange(to_expert_major.numel(), device=z.device)
        grouped = dispatch_rows(received, to_expert_major, to_rank_major, 1)
        handle = AllToAllHandle(local, send_splits, recv_splits, to_expert_major, to_rank_major)
        return grouped, recv_counts.sum(0), handle

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """y [M_recv, ℓ] (this rank's expert outputs, expert-major), weights [N, k] → u [N, ℓ]."""
        back = dispatch_rows(y, handle.to_rank_major, handle.to_expert_major, 1)
        rows = _AllToAll.apply(back, handle.recv_splits, handle.send_splits, self.group)
        return self.sort.combine(rows, weights, handle.local)


def token_dispatcher(num_experts: int, ep_group: dist.ProcessGroup | None, ep_size: int):
    """The dispatcher for an expert-parallel size: local sorting at 1, all-to-all above."""
    if ep_size == 1:
        return LocalTokenDispatcher(num_experts)
    return AllToAllTokenDispatcher(num_experts, ep_group)
