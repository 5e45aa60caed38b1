"""How a sequence is laid out over the context-parallel (CP) ranks, and how the ranks gather it.

Load-balanced causal split (issue 12; Megatron-Core's CP layout): a row of T tokens is cut into
2C chunks of L = T / 2C tokens; CP rank r holds chunks r and 2C−1−r, concatenated. Under a causal
mask chunk c attends to c + 1 chunks, so every rank does (r + 1) + (2C − r) = 2C + 1 chunk-pairs
of attention work. Local token j of rank r is global token

    r·L + j                 (j < L)
    (2C−1−r)·L + j − L      (j ≥ L).

Per-chunk values are exchanged as [2, *] (this rank's two chunks, in local order) and gathered
into [2C, *] in global chunk order by ``all_chunks``, whose backward returns each rank the summed
gradient of its chunks (so the ranks' losses add up to the whole row's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    """[C, *shape] of every rank's x; the backward sums the C ranks' gradients of x's copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_with_grad(x: torch.Tensor, group) -> torch.Tensor:
    """[C, *x.shape]: x of each rank of ``group``; differentiable (the backward all-reduces).

    With grad enabled the gather is always in the graph, even where x needs no gradient on this
    rank (e.g. KDA transitions that are all constant zeros because a document starts in every
    chunk): its backward is a collective that every rank must join. Callers keep one gather per
    dependency level (e.g. one per KDA layer for M and S together), so that the backward meets
    the collectives in the same order on every rank."""
    if torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return _AllGather.apply(x, group)


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in the CP group: ``size`` = C ranks, ``rank`` = r."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunk indices this rank holds, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot) holding global chunk ``chunk``."""
        return (chunk, 0) if chunk < self.size else (2 * self.size - 1 - chunk, 1)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of a whole row: chunks r and 2C−1−r of ``x`` along ``dim``."""
        parts = x.chunk(2 * self.size, dim)
        if parts[0].shape[dim] * 2 * self.size != x.shape[dim]:
            raise ValueError(f"context parallel: length {x.shape[dim]} is not divisible by 2*context="
                             f"{2 * self.size}")
        return torch.cat([parts[c] for c in self.chunks], dim)

    def global_index(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """[local_len] int64: the global position of each local token."""
        L = local_len // 2
        return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in self.chunks])

    def all_chunks(self, slots: torch.Tensor) -> torch.Tensor:
        """[2, *] (this rank's chunks) → [2C, *] (every chunk, global order); differentiable."""
        gathered = all_gather_with_grad(slots, self.group)  # [C, 2, *]
        return torch.stack([gathered[self.owner(c)] for c in range(2 * self.size)])

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T/C, *] (this rank's share) → [B, T, *] (the whole rows); differentiable."""
        B, T_local = x.shape[:2]
        slots = x.reshape(B, 2, T_local // 2, *x.shape[2:]).transpose(0, 1)  # [2, B, L, *]
        full = self.all_chunks(slots)  # [2C, B, L, *]
        return full.transpose(0, 1).reshape(B, self.size * T_local, *x.shape[2:])

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over the CP ranks of a tensor that needs no gradient."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x
