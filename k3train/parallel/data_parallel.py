"""Data-parallel gradient averaging and TP-aware global gradient norm and clipping.

Megatron-Core's DDP and ``clip_grads`` assume CUDA; these run on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3train.model.roles import get_role
from k3train.parallel.state import ParallelGroups


def _buckets(grads: list[torch.Tensor], limit: int):
    """Consecutive runs of same-dtype gradients of at most ``limit`` bytes."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > limit or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def average_gradients(params: list[nn.Parameter], groups: ParallelGroups, bucket_bytes: int = 64 << 20) -> None:
    """g ← mean over DP ranks of g, in flat buckets of at most ``bucket_bytes`` (one collective each)."""
    if groups.dp_size == 1:
        return
    for bucket in _buckets([p.grad for p in params if p.grad is not None], bucket_bytes):
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat, group=groups.dp)
        flat /= groups.dp_size
        torch._foreach_copy_(bucket, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


def global_grad_norm(params: list[nn.Parameter], groups: ParallelGroups | None) -> torch.Tensor:
    """‖g‖₂ of the full model: TP-sharded gradients are summed over TP ranks, replicated ones counted once."""
    device = params[0].device
    sharded = torch.zeros((), device=device, dtype=torch.float32)
    replicated = torch.zeros((), device=device, dtype=torch.float32)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.float().pow(2).sum()
        role = get_role(p)
        if role is not None and role.tp_partition_dim is not None:
            sharded += sq
        else:
            replicated += sq
    if groups is not None and groups.tp_size > 1:
        dist.all_reduce(sharded, group=groups.tp)
    return (sharded + replicated).sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale all gradients by min(1, max_norm / ‖g‖) (no-op when max_norm is 0 or ‖g‖ is not finite)."""
    if max_norm <= 0 or not torch.isfinite(total_norm):
        return
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
