"""The optimizer-builder seam: one place that turns (model, OptimConfig) into an optimizer
and its learning-rate schedule.

- ``adamw``: torch AdamW; weight decay off for parameters whose role says so
  (norms, pseudo-queries, gate parameters, vectors).
- ``muon``: per-head Muon for hidden matrices plus AdamW for the rest (``k3train.optim.muon``).

Either steps the main weights (``k3train.precision.main_params.main_param``): the fp32 copies under
bf16 parameters, the parameters themselves otherwise.

Schedule: linear warmup over ``warmup_fraction`` of the steps (at least one), then cosine
decay from ``lr`` to ``lr·min_lr_ratio``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3train.config.schema import OptimConfig
from k3train.model.roles import require_role
from k3train.parallel.state import ParallelGroups
from k3train.precision.main_params import main_param


def build_optimizer(model: nn.Module, cfg: OptimConfig, groups: ParallelGroups | None = None
                    ) -> torch.optim.Optimizer:
    named = [(n, main_param(p)) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.name == "muon":
        from k3train.optim.muon import build_muon

        if groups is None:
            return build_muon(named, cfg)
        # expert stacks sharded over EP share out their Newton–Schulz work over the expert-DP ranks
        expert_dp = groups.expert_dp if groups.ep_size > 1 else None
        return build_muon(named, cfg, dp_group=groups.dp_cp, tp_group=groups.tp, expert_dp_group=expert_dp)
    decay, no_decay = [], []
    for name, p in named:
        (no_decay if require_role(name, p).no_weight_decay else decay).append(p)
    param_groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                    {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for _, p in named)
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


def lr_multiplier(step: int, total_steps: int, warmup_fraction: float, min_lr_ratio: float) -> float:
    """LR / peak LR at optimizer step ``step`` (0-based): linear warmup then cosine to min_lr_ratio."""
    warmup = max(1, math.ceil(warmup_fraction * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, cfg.warmup_fraction, cfg.min_lr_ratio))
