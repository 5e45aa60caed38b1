"""Data-parallel gradient averaging and TP/EP-aware global gradient norm and clipping.

Megatron-Core's DDP and ``clip_grads`` assume CUDA; these run on gloo and NCCL alike.

The loss is the mean over the DP ranks of each rank's mean loss. A replicated parameter's gradient
is averaged over DP. An expert-parallel parameter (a routed-expert stack) already holds, after the
dispatcher's backward all-to-all, the sum over its EP group's ranks of their losses' gradients;
it is summed over the ranks that hold the same experts (``expert_dp``) and divided by the full
DP size, which gives the same mean.
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


def _is_expert_parallel(p: torch.Tensor) -> bool:
    role = get_role(p)
    return role is not None and role.ep_partition_dim is not None


def _reduce(grads: list[torch.Tensor], group, divisor: int, bucket_bytes: int) -> None:
    """g ← (Σ_group g) / divisor, in flat buckets (one all-reduce each)."""
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= divisor
        torch._foreach_copy_(bucket, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


def average_gradients(params: list[nn.Parameter], groups: ParallelGroups, bucket_bytes: int = 64 << 20) -> None:
    """Replicated parameters: g ← mean over DP×CP of g. Expert-parallel ones: g ← (Σ_expert_dp g) / dp_cp_size.

    A parameter without a gradient on this rank (no token reached an expert stack) gets a zero one
    first, so that every rank reduces the same buckets."""
    if groups.dp_cp_size == 1:
        return
    for p in params:
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    grads = [(p.grad, groups.ep_size > 1 and _is_expert_parallel(p)) for p in params if p.grad is not None]
    _reduce([g for g, ep in grads if not ep], groups.dp_cp, groups.dp_cp_size, bucket_bytes)
    expert = [g for g, ep in grads if ep]
    if expert and groups.expert_dp_size > 1:
        _reduce(expert, groups.expert_dp, groups.dp_cp_size, bucket_bytes)
    elif expert:
        torch._foreach_div_(expert, groups.dp_cp_size)


def global_grad_norm(params: list[nn.Parameter], groups: ParallelGroups | None) -> torch.Tensor:
    """‖g‖₂ of the full model: squares of TP-sharded gradients are summed over TP ranks, of
    expert-parallel ones over EP (and TP if also TP-sharded), replicated ones counted once; the
    stages' sums are added over PP."""
    device = params[0].device
    # squared sums by (expert-parallel, TP-sharded)
    sq = {key: torch.zeros((), device=device, dtype=torch.float32) for key in
          ((False, False), (False, True), (True, False), (True, True))}
    for p in params:
        if p.grad is None:
            continue
        role = get_role(p)
        key = (role is not None and role.ep_partition_dim is not None,
               role is not None and role.tp_partition_dim is not None)
        sq[key] += p.grad.float().pow(2).sum()
    expert = torch.stack([sq[True, False], sq[True, True]])
    if groups is not None and groups.ep_size > 1:
        dist.all_reduce(expert, group=groups.ep)
    tp_sharded = sq[False, True] + expert[1]
    if groups is not None and groups.tp_size > 1:
        dist.all_reduce(tp_sharded, group=groups.tp)
    total = tp_sharded + expert[0] + sq[False, False]
    if groups is not None and groups.pp_size > 1:  # pipeline stages hold disjoint parameters
        dist.all_reduce(total, group=groups.pp)
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale all gradients by min(1, max_norm / ‖g‖) (no-op when max_norm is 0 or ‖g‖ is not finite)."""
    if max_norm <= 0 or not torch.isfinite(total_norm):
        return
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
