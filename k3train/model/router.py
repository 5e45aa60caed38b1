"""Sigmoid top-k router with a selection-only bias (K3_SPEC.md §2.4 step 1, §2.5 step 1).

For tokens x [N, d], in fp32:

    s = σ(W_r x) ∈ (0, 1)^E
    T = argtop_k(s + b)             the bias b only changes which experts are chosen
    p_j = s_j / Σ_{i∈T} s_i · ρ     renormalised weights of the chosen experts (ρ = 1)
    α = (k+1)-th largest of s + b   the cutoff Quantile Balancing needs

``b`` (``e_score_correction_bias``) is a buffer: no gradient, not an optimizer parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role


@dataclass
class Routing:
    experts: torch.Tensor  # [N, k] int64 chosen expert ids
    weights: torch.Tensor  # [N, k] fp32 renormalised gate weights (differentiable)
    scores: torch.Tensor  # [N, E] fp32 raw sigmoid scores (detached)
    cutoff: torch.Tensor  # [N] fp32 (k+1)-th biased score (detached)


class SigmoidRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float, init_std: float):
        super().__init__()
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k={top_k} must be in (0, num_experts={num_experts})")
        self.top_k = top_k
        self.scaling = scaling
        self.weight = set_role(nn.Parameter(torch.empty(num_experts, hidden).normal_(0.0, init_std)),
                               ParamRole(Kind.MATRIX))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(device_type=x.device.type, enabled=False):
            s = torch.sigmoid(x.float() @ self.weight.float().t())  # [N, E]
        biased = s.detach() + self.e_score_correction_bias
        top_vals, top_idx = biased.topk(self.top_k + 1, dim=-1)
        experts = top_idx[:, : self.top_k]
        chosen = s.gather(1, experts)
        weights = chosen / chosen.sum(-1, keepdim=True) * self.scaling
        return Routing(experts=experts, weights=weights, scores=s.detach(), cutoff=top_vals[:, self.top_k])
