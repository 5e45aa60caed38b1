"""Stable LatentMoE (K3_SPEC.md §2.4).

For the MoE input x [N, d] (after ``post_attention_layernorm``):

    (T, p)  = router(x)                               top-k experts and renormalised weights
    z       = W↓ x                                    latent [N, ℓ], ℓ = d/2
    u       = Σ_{j∈T} p_j · W2_j SiTU(W1_j z, W3_j z)  routed experts in the latent
    y       = Shared(x) + W↑ · RMSNorm_γ(u)

Under tensor parallelism each routed expert is split along its width I (W1/W3 rows,
W2 columns), so u is a partial sum per rank; it is all-reduced *before* the norm.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.model.mlp import SiTUMLP, situ_glu
from k3train.model.norm import RMSNorm
from k3train.model.quantile_balancing import QuantileBalancer
from k3train.model.roles import Kind, ParamRole, set_role
from k3train.model.router import SigmoidRouter
from k3train.parallel.tensor_parallel import TPSpec


class RoutedExperts(nn.Module):
    """E experts in the latent space, stacked for grouped GEMMs.

    w13: [E, 2·I_local, ℓ] (this rank's gate rows, then its up rows); w2: [E, ℓ, I_local].
    ``weight_fake_quant`` / ``input_fake_quant``: optional callables applied to every expert
    weight and GEMM input (quantization-aware training; None means full precision).
    """

    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        E, ell, I = cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.width = tp.local(I, "model.moe_intermediate_size")
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        w13 = torch.empty(E, 2 * I, ell).normal_(0.0, cfg.init_std)
        w2 = torch.empty(E, ell, I).normal_(0.0, cfg.init_std)
        self.w13 = set_role(nn.Parameter(tp.shard(w13, 1, stride=2)),
                            ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=1, tp_partition_stride=2))
        self.w2 = set_role(nn.Parameter(tp.shard(w2, 2)), ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=2))
        self.weight_fake_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.input_fake_quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.input_fake_quant is not None:
            x = self.input_fake_quant(x)
        if self.weight_fake_quant is not None:
            w = self.weight_fake_quant(w)
        return x @ w.t()

    def forward(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, ℓ], experts/weights [N, k] → u [N, ℓ] (a TP partial sum)."""
        N, k = experts.shape
        flat_expert = experts.flatten()
        order = flat_expert.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        x_sorted = z[token_of]
        outputs = []
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            xe = x_sorted[start:start + count]
            gate, up = self._gemm(xe, self.w13[e]).chunk(2, dim=-1)
            outputs.append(self._gemm(situ_glu(gate, up, self.beta, self.linear_beta), self.w2[e]))
            start += count
        y = torch.cat(outputs) * weights.flatten()[order].unsqueeze(-1).to(z.dtype)
        return torch.zeros_like(z).index_add_(0, token_of, y.to(z.dtype))


class LatentMoE(nn.Module):
    """Input/output [B, T, d]. ``last_load`` holds tokens per expert of the last forward."""

    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        self.tp = tp
        d, ell = cfg.hidden_size, cfg.latent_size
        self.gate = SigmoidRouter(d, cfg.num_experts, cfg.num_experts_per_token, cfg.routed_scaling_factor,
                                  cfg.init_std)
        self.routed_expert_down_proj = tp.replicated(d, ell)
        self.experts = RoutedExperts(cfg, tp)
        self.routed_expert_norm = RMSNorm(ell, cfg.rms_norm_eps)
        self.routed_expert_up_proj = tp.replicated(ell, d)
        self.shared_experts = SiTUMLP(tp, d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                      cfg.situ_beta, cfg.situ_linear_beta)
        self.balancer = QuantileBalancer(cfg.num_experts, cfg.num_experts_per_token, cfg.qb_estimator,
                                         cfg.qb_bins, cfg.qb_ema)
        self.register_buffer("last_load", torch.zeros(cfg.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.gate(x)
        if self.training:
            self.balancer.observe(routing.scores, routing.cutoff, self.gate.e_score_correction_bias)
        self.last_load = torch.bincount(routing.experts.flatten(), minlength=self.experts.num_experts).float()
        z = self.tp.copy_to_tp(self.routed_expert_down_proj(x))
        u = self.experts(z, routing.experts, self.tp.copy_to_tp(routing.weights))
        u = self.tp.reduce_from_tp(u)
        y = self.shared_experts(x) + self.routed_expert_up_proj(self.routed_expert_norm(u))
        return y.view(shape)
