"""Sigmoid top-k router with a selection-only bias (K3_SPEC.md §2.4 step 1, §2.5 step 1).

For tokens x [N, d], in fp32:

    s = σ(W_r x) ∈ (0, 1)^E
    T = argtop_k(s + b)             the bias b only changes which experts are chosen
    p_j = s_j / Σ_{i∈T} s_i · ρ     renormalised weights of the chosen experts (ρ = 1)
    α = (k+1)-th largest of s + b   the cutoff Quantile Balancing needs

``b`` (``e_score_correction_bias``) is a buffer: no gradient, not an optimizer parameter.

After the fp32 GEMM the rest is ``kernels.router.route``: on CUDA one fused Triton launch forward
and one backward, elsewhere (and under torch.compile) the same math in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role
from kernels.router import route


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
        # fp32 also with bf16 parameters (K3_SPEC §2.4: the router runs in fp32): no cast each forward
        self.weight = set_role(nn.Parameter(torch.empty(num_experts, hidden).normal_(0.0, init_std)),
                               ParamRole(Kind.MATRIX, keep_fp32=True))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = x.float() @ self.weight.float().t()  # [N, E] fp32
        weights, experts, scores, cutoff = route(logits, self.e_score_correction_bias, self.top_k, self.scaling)
        return Routing(experts=experts, weights=weights, scores=scores, cutoff=cutoff)
