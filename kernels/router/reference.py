"""The MoE sigmoid router's tail in plain torch: the reference of the Triton kernels and the CPU path.

For router logits z [N, E] (fp32, the router GEMM's output), the bias b [E] and k < E, per row:

    s = σ(z) ∈ (0, 1)^E                 scores (returned detached)
    T = argtop_k(s + b)                 the bias only changes which experts are chosen
    S = Σ_{j∈T} s_j
    w_i = ρ · s_i / S   for i ∈ T       the k renormalised weights, in T's order (ρ = ``scaling``)
    α = (k+1)-th largest of s + b       the cutoff (Quantile Balancing)

T and α come from one ``torch.topk`` of the k+1 largest biased scores (descending): the experts
are its first k indices, α its last value. Only the weights carry a gradient (to z); the bias,
the experts, the scores and the cutoff carry none.

Backward, with dw [N, k] the weights' gradient:

    ds_i = (ρ/S) · (dw_i − Σ_{j∈T} dw_j s_j / S)    for i ∈ T,   ds_i = 0 elsewhere
    dz   = ds ⊙ s(1 − s)                              dense [N, E], fp32
"""

from __future__ import annotations

import torch


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32, bias [E] fp32 → (weights [N, k] fp32 (differentiable), experts [N, k] int64,
    scores [N, E] fp32 (detached), cutoff [N] fp32 (detached))."""
    s = torch.sigmoid(logits)
    biased = s.detach() + bias.detach()
    top_vals, top_idx = biased.topk(top_k + 1, dim=-1)
    experts = top_idx[:, :top_k]
    chosen = s.gather(1, experts)
    weights = chosen / chosen.sum(-1, keepdim=True) * scaling
    return weights, experts, s.detach(), top_vals[:, top_k]
