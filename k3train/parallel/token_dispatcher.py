"""Token dispatcher seam of the MoE layer (SEAMS.md §1): dispatch → grouped expert GEMMs → combine.

The MoE layer calls, whatever the implementation:

    x_grouped, tokens_per_expert, handle = dispatcher.dispatch(z, experts, row_tile, weights)
    y_grouped = routed_experts(x_grouped, tokens_per_expert)
    u = dispatcher.combine(y_grouped, weights, handle)

or, where ``dispatcher.grouped_weights(handle)`` gives each grouped row its gate weight (the local dispatcher, when
dispatch was given the weights; None elsewhere), with the weights applied inside the experts and an unweighted
combine (``weights=None``), whose backward then need not read y again.

with z [N, ℓ] latent tokens, experts/weights [N, k] (chosen ids, gate weights), x_grouped/y_grouped
[M, ℓ] token copies sorted by expert (M = N·k locally) and tokens_per_expert [E_local] int64 on
the device. Nothing here waits on the host: shapes depend on N and k only. ``row_tile`` > 1 (the
expert-tiled GEMMs' tile rows; local dispatch only) pads each expert's rows with zero rows to a multiple
of it: M is then a fixed bound (``moe_plan.layout_rows``), tokens_per_expert counts the
padded rows, and rows past the last expert's are padding too.

``LocalTokenDispatcher`` (expert parallel size 1) plans the grouped layout with ``kernels.moe_plan`` (a stable
sort by expert; its Triton counting sort where asked) and permutes by index through
``kernels.moe_permute``: fused Triton gathers/scatters on CUDA, the torch references elsewhere.
Both permutations have gather-only backwards (no atomics), so the layer is deterministic on GPU.
``ExpertParallelDispatcher`` (``parallel.expert`` > 1) adds the exchange of rows between the
expert-parallel ranks around it, plain (every copy at its expert's home) or balanced (replicas
of hot experts, ``expert_balance``); ``token_dispatcher`` picks one. Every dispatcher also gives
the expert weight stacks for its groups (``expert_stacks``): the balanced one appends fetched
replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3train.parallel.expert_balance import balanced_plan, home_plan, replica_slots
from kernels.moe_permute import combine_rows, dispatch_rows, dispatch_weighted_rows
from kernels.moe_plan import inverse_permutation, routing_plan, stable_sort


@dataclass
class DispatchHandle:
    """What ``combine`` needs to undo ``dispatch``: ``order[m]`` is the token copy (i·k + j) at
    grouped row m, ``inverse`` its inverse permutation; ``tokens_per_expert`` counts this rank's
    token copies per expert (all E, for the load metrics). In the padded layout ``order`` stays the packed
    sort and ``inverse`` gives each copy's padded row; ``pad_rows`` lists the rest. ``layout``: the grouped
    GEMMs' view of the rows, (offsets, tile_group) as ``kernels.moe_plan.group_offsets`` gives it, where the
    routing plan made it."""

    order: torch.Tensor  # [N·k] int64
    inverse: torch.Tensor  # [N·k] int64: the grouped row of each token copy
    top_k: int
    tokens_per_expert: torch.Tensor  # [E] int64
    pad_rows: torch.Tensor | None = None  # the grouped rows that hold no copy (row_tile > 1)
    layout: tuple[torch.Tensor, torch.Tensor | None] | None = None  # offsets [E] int32, tile_group [R / row_tile]
    row_weights: torch.Tensor | None = None  # [rows]: each grouped row's gate weight, where dispatch was given them


class LocalTokenDispatcher:
    """All experts on this rank: sort token copies by expert, then weight and sum them back.

    ``plan_backend``: ``kernels.moe_plan``'s backend for the routing plan. "auto": Triton's four kernels on a GPU
    (as fast as the torch reference's ~20 on the packed layout, 0.025-0.048 ms faster per fwd+bwd on the padded
    one; ``benchmarks/moe.py --plans torch,auto``, docs/moe_notes.md §2), the torch reference on CPU."""

    def __init__(self, num_experts: int, plan_backend: str = "auto"):
        self.num_experts, self.plan_backend = num_experts, plan_backend

    def dispatch(self, z: torch.Tensor, experts: torch.Tensor, row_tile: int = 1, weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """z [N, ℓ], experts [N, k] → grouped rows [N·k, ℓ], tokens per expert [E], handle; with
        ``row_tile`` > 1 the padded layout (module docstring): [capacity · row_tile, ℓ] and padded counts. With the
        gate ``weights`` [N, k], each grouped row's weight is dispatched in the same launch as the rows
        (``handle.row_weights``, what ``grouped_weights`` gives; on an H200 at bench-1B a launch of its own each
        way took ~2-4 µs)."""
        plan = routing_plan(experts, self.num_experts, row_tile, self.plan_backend)
        k = experts.shape[1]
        handle = DispatchHandle(plan.order, plan.inverse, k, plan.counts, plan.pad_rows,
                                (plan.offsets, plan.tile_group))
        if weights is None:
            return dispatch_rows(z, plan.order, plan.inverse, k, pad_rows=plan.pad_rows), plan.group_rows, handle
        rows, handle.row_weights = dispatch_weighted_rows(z, weights, plan.order, plan.inverse, k,
                                                          pad_rows=plan.pad_rows)
        return rows, plan.group_rows, handle

    def expert_stacks(self, experts, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of the grouped rows: the experts' own stacks."""
        return experts.w13, experts.w2

    def group_layout(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The grouped rows' (offsets, tile_group), made by the routing plan (``RoutedExperts.forward``'s
        ``layout``)."""
        return handle.layout

    def grouped_weights(self, handle: DispatchHandle) -> torch.Tensor | None:
        """[rows of dispatch's output]: each grouped row's gate weight (0 on padding rows), made by ``dispatch``
        when it was given the weights (a gather backward), else None."""
        return handle.row_weights

    def combine(self, y: torch.Tensor, weights: torch.Tensor | None, handle: DispatchHandle) -> torch.Tensor:
        """y [N·k, ℓ] grouped (or padded), weights [N, k] → u [N, ℓ], u_i = Σ_j weights_ij · y_(i,j); weights
        None: the rows are weighted already (``grouped_weights``), u_i = Σ_j y_(i,j)."""
        if weights is None:
            weights = y.new_ones(handle.inverse.numel() // handle.top_k, handle.top_k)
        return combine_rows(y, weights, handle.order, handle.inverse, pad_rows=handle.pad_rows)


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
class ExpertParallelHandle:
    """What ``ExpertParallelDispatcher.combine`` needs: the local sort, this rank's copies in
    (destination rank, group) order, the row counts sent to / received from each rank, the
    received rows' reordering to group-major, and the replica experts this rank computes."""

    local: DispatchHandle
    to_send_order: torch.Tensor  # [N·k]: sent row m is expert-sorted row [m]
    to_expert_order: torch.Tensor  # its inverse
    send_splits: list[int]
    recv_splits: list[int]
    to_group_major: torch.Tensor  # [M_recv]: group-major row m is received row [m]
    to_rank_major: torch.Tensor  # its inverse
    replicas: list[int]  # global ids of the replica experts computed here, in slot order
    fetch_send: list[int]  # local expert ids whose weights this rank sends, in (rank, slot) order
    fetch_send_splits: list[int]
    fetch_recv_splits: list[int]

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """This rank's token copies per expert, all E of them [E]."""
        return self.local.tokens_per_expert


class ExpertParallelDispatcher:
    """Experts sharded over the expert-parallel group: rank r is home to experts [r·E_l, (r+1)·E_l).

    dispatch:
    1. sort the N·k token copies by expert and all-gather the per-rank counts C [R, E] (one
       collective, read on the host);
    2. plan where each expert's copies are computed (``expert_balance``): all at home
       (``balanced=False``, plain all-to-all EP) or spread so that every rank computes exactly
       N·k copies, with replicas of hot experts on under-loaded ranks (``balanced=True``);
    3. send each copy to its rank by all-to-all at the latent width ℓ, ordered there by group:
       the E_l home experts, then E_l replica slots (balanced only);
    4. ``expert_stacks`` fetches the replicas' weights from their home ranks by all-to-all
       (its backward sends their gradients home, where autograd adds them to the home stacks).
    combine undoes 3 and 1 and takes the weighted sum. Routing, home placement and the sums
    are those of one rank; only fp32 summation order differs. Every rank joins every
    collective, with or without rows.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, balanced: bool = False):
        self.group, self.balanced = group, balanced
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(f"model.num_experts={num_experts} is not divisible by parallel.expert={self.size}")
        self.num_experts, self.local_experts = num_experts, num_experts // self.size
        self.groups_per_rank = self.local_experts * (2 if balanced else 1)
        self.sort = LocalTokenDispatcher(num_experts)

    def _plan(self, counts: torch.Tensor):
        """counts [R, E] (host) → alloc [E, R] (copies of e computed on d), slots [E, R] (replica
        slot of e on d, −1: none), overlap [R (source), E, R (destination)] (copies of e that
        source s sends to d) and lo_s [R, E] (copies of e on the source ranks before s)."""
        R, E_l = self.size, self.local_experts
        T = counts.sum(0)
        alloc = balanced_plan(T, R) if self.balanced else home_plan(T, R)
        slots = replica_slots(alloc)
        if int(slots.max()) >= E_l:
            raise AssertionError(f"the plan needs {int(slots.max()) + 1} replica slots on a rank, above E/R = {E_l}")
        cum = alloc.cumsum(1)  # [E, R]: copies of e on ranks ≤ d
        lo_d = cum - alloc
        lo_s = counts.cumsum(0) - counts
        hi_s = lo_s + counts
        overlap = (torch.minimum(hi_s[:, :, None], cum[None]) - torch.maximum(lo_s[:, :, None], lo_d[None])).clamp(min=0)
        return alloc, slots, overlap, lo_s

    def _group_of(self, experts: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Group of expert ``experts`` on rank ``dest``: its local index at home, E_l + slot elsewhere."""
        E_l = self.local_experts
        home = experts // E_l
        return torch.where(home == dest, experts - dest * E_l, E_l + slots[experts, dest])

    def _send_order(self, counts, alloc, slots, lo_s, n_copies: int, dev) -> torch.Tensor:
        """Order [N·k] of my expert-sorted copies by (destination rank, group there): copy i of
        expert e (counted in source-rank order) goes to the first d with cumsum_d alloc[e, d] > i.
        On the device; only the [E, R] plan is on the host."""
        mine = counts[self.rank].to(dev)
        expert = torch.arange(self.num_experts, device=dev).repeat_interleave(mine, output_size=n_copies)
        first_copy = lo_s[self.rank].to(dev) - (mine.cumsum(0) - mine)
        index = first_copy[expert] + torch.arange(n_copies, device=dev)
        dest = torch.searchsorted(alloc.to(dev).cumsum(1)[expert], index[:, None], right=True).squeeze(1)
        key = dest * self.groups_per_rank + self._group_of(expert, dest, slots.to(dev))
        return stable_sort(key, self.size * self.groups_per_rank)[1]

    def _receive_order(self, alloc, slots, overlap, dev) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Rows received from each source arrive in that source's group order; → the order [M]
        that makes them group-major, the rows per group [G] and the rows per source [R]."""
        R, G = self.size, self.groups_per_rank
        here = overlap[:, :, self.rank]  # [R (source), E]
        computed_here = (alloc[:, self.rank] > 0).nonzero().squeeze(1)
        group_here = self._group_of(computed_here, torch.full_like(computed_here, self.rank), slots)
        per_group = torch.zeros(R, G, dtype=torch.int64)
        per_group[:, group_here] = here[:, computed_here]
        recv_splits = here.sum(1).tolist()
        block = torch.arange(R * G, device=dev).repeat_interleave(per_group.flatten().to(dev),
                                                                  output_size=sum(recv_splits))
        return ((block % G) * R + block // G).argsort(stable=True), per_group.sum(0).to(dev), recv_splits

    def _fetch_plan(self, slots) -> tuple[list[int], list[int], list[int], list[int]]:
        """Replica experts computed here (slot order); the local experts whose weights I send, in
        (destination, slot) order, with the counts sent to and received from each rank."""
        R, E_l, lo = self.size, self.local_experts, self.rank * self.local_experts
        replicas = [int(e) for e in (slots[:, self.rank] >= 0).nonzero().squeeze(1)]
        send, send_splits = [], []
        for d in range(R):
            needed = [e - lo for e in range(lo, lo + E_l) if slots[e, d] >= 0]
            send += needed
            send_splits.append(len(needed))
        recv_splits = [sum(1 for e in replicas if e // E_l == h) for h in range(R)]
        return replicas, send, send_splits, recv_splits

    def dispatch(self, z: torch.Tensor, experts: torch.Tensor, row_tile: int = 1, weights: torch.Tensor | None = None):
        """z [N, ℓ], experts [N, k] (global ids) → rows computed here [M, ℓ] sorted by group,
        tokens per group [E_l] (home experts) or [2·E_l] (then the replica slots), handle. ``weights`` are not
        used: the gate weights stay with their tokens (``combine`` applies them)."""
        if row_tile != 1:
            raise ValueError("expert-tiled grouped GEMMs (rows padded per expert) run without expert parallelism "
                             "for now: set parallel.expert=1, or use the 'torch' or 'cutlass:<i>' grouped GEMMs")
        rows, tokens_per_expert, local = self.sort.dispatch(z, experts)
        gathered = [torch.empty_like(tokens_per_expert) for _ in range(self.size)]
        dist.all_gather(gathered, tokens_per_expert, group=self.group)
        counts = torch.stack(gathered).cpu()  # [R, E], the one host read of the layer
        alloc, slots, overlap, lo_s = self._plan(counts)
        to_send = self._send_order(counts, alloc, slots, lo_s, rows.shape[0], z.device)
        to_group, tokens_per_group, recv_splits = self._receive_order(alloc, slots, overlap, z.device)
        send_splits = overlap[self.rank].sum(0).tolist()
        to_expert, to_rank = inverse_permutation(to_send), inverse_permutation(to_group)

        sent = dispatch_rows(rows, to_send, to_expert, 1)
        received = _AllToAll.apply(sent, send_splits, recv_splits, self.group)
        grouped = dispatch_rows(received, to_group, to_rank, 1)
        handle = ExpertParallelHandle(local, to_send, to_expert, send_splits, recv_splits, to_group, to_rank,
                                      *self._fetch_plan(slots))
        return grouped, tokens_per_group, handle

    def expert_stacks(self, experts, handle: ExpertParallelHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) for the groups of ``dispatch``: the home stacks, then (balanced) the replica
        slots, fetched from their home ranks (unused slots are zero; no row reads them)."""
        if not self.balanced:
            return experts.w13, experts.w2
        out = []
        for w in (experts.w13, experts.w2):
            index = torch.tensor(handle.fetch_send, dtype=torch.long, device=w.device)
            send = w.index_select(0, index).flatten(1)
            got = _AllToAll.apply(send, handle.fetch_send_splits, handle.fetch_recv_splits, self.group)
            pad = w.new_zeros(self.local_experts - got.shape[0], got.shape[1])
            out.append(torch.cat([w, torch.cat([got, pad]).view(self.local_experts, *w.shape[1:])]))
        return out[0], out[1]

    def group_layout(self, handle: ExpertParallelHandle) -> None:
        """None: the experts make the received rows' layout themselves (``group_offsets``)."""
        return None

    def grouped_weights(self, handle: ExpertParallelHandle) -> None:
        """None: the gate weights stay with their tokens here (combine applies them)."""
        return None

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: ExpertParallelHandle) -> torch.Tensor:
        """y [M, ℓ] (rows computed here, group-major), weights [N, k] → u [N, ℓ]."""
        back = dispatch_rows(y, handle.to_rank_major, handle.to_group_major, 1)
        sent = _AllToAll.apply(back, handle.recv_splits, handle.send_splits, self.group)
        rows = dispatch_rows(sent, handle.to_expert_order, handle.to_send_order, 1)
        return self.sort.combine(rows, weights, handle.local)


def token_dispatcher(num_experts: int, ep_group: dist.ProcessGroup | None, ep_size: int, kind: str = "alltoall"):
    """The dispatcher for an expert-parallel size: local sorting at 1; above, all-to-all with every
    copy at home (``"alltoall"``) or balanced with replicas (``"balanced"``)."""
    if ep_size == 1:
        return LocalTokenDispatcher(num_experts)
    if kind not in ("alltoall", "balanced"):
        raise ValueError(f"parallel.ep_dispatcher={kind!r}: use alltoall or balanced")
    return ExpertParallelDispatcher(num_experts, ep_group, balanced=kind == "balanced")
