"""The optimizer figures a step logs, for the whole model: Muon's update RMS, and QK-clip's clipped heads
and largest logit.

Each rank holds only part of the model (its TP shards, its experts, its pipeline stage), so the figures
are pooled over the ranks of one model copy (``ParallelGroups.tp_ep_pp``) with one all-gather of four
numbers per rank. Dense weights and MLA heads are replicated over that group's EP ranks and count on EP
rank 0 only; a weight every TP rank holds whole counts on TP rank 0 only (``K3Muon`` reports its sums so).
QK-clip's per-head maxima are already pooled over DP×CP, so any copy gives the same figures.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from k3train.parallel.state import ParallelGroups


def optimizer_metrics(muon: dict | None, qk_clip: dict | None, groups: ParallelGroups,
                      device: torch.device) -> dict:
    """``muon``: ``K3Muon.last_step_info`` of an applied step ({} when this rank updated nothing), None
    without Muon; ``qk_clip``: ``apply_qk_clip``'s report, None when off. Which of them are None must be
    the same on every rank (the all-gather)."""
    if muon is None and qk_clip is None:
        return {}
    dense = float(groups.ep_rank == 0)
    heads, max_logit = (qk_clip["num_clipped_heads"], qk_clip["max_logit"]) if qk_clip else (0, -math.inf)
    share = torch.tensor([heads * dense, max_logit, 0.0, 0.0], dtype=torch.float64, device=device)
    if muon and "update_sumsq" in muon:
        sumsq, numel = muon["update_sumsq"].double(), muon["update_numel"]
        share[2] = sumsq[0] * dense + sumsq[1]
        share[3] = numel[0] * dense + numel[1]
    if groups.tp_ep_pp_size > 1:
        parts = [torch.empty_like(share) for _ in range(groups.tp_ep_pp_size)]
        dist.all_gather(parts, share, group=groups.tp_ep_pp)
        share = torch.stack(parts)
    share = share.reshape(-1, 4)
    heads, max_logit, sumsq, numel = torch.cat([share[:, :1].sum(0), share[:, 1].max().reshape(1),
                                                share[:, 2:].sum(0)]).tolist()
    out = {}
    if muon is not None and numel > 0:
        out["muon_update_rms"] = math.sqrt(sumsq / numel)
    if qk_clip is not None:
        out["qk_clip_heads"] = int(heads)
        out["qk_max_logit"] = max_logit if math.isfinite(max_logit) else None
    return out
