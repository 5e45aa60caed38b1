"""Closed-form parameter counts (K3_SPEC.md §1, "Parameter count").

Total counts every weight plus the router's correction bias (E per MoE layer), with A_log
unpadded ([H]). Active = total − V·d (input embedding) − (#MoE layers)·(E − k)·(3 ℓ I_e):
it includes the LM head and only the k routed experts a token uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3train.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int


def kda_params(c: ModelConfig) -> int:
    d, H, h = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    P = H * h
    return 4 * d * P + P * d + 3 * c.kda_conv_size * P + d * h + h * P + d * H + H + P + h


def mla_params(c: ModelConfig) -> int:
    d, H = c.hidden_size, c.mla_num_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    kv_out = c.qk_nope_head_dim + c.v_head_dim
    return (c.q_lora_rank * d + c.q_lora_rank + c.q_lora_rank * qk * H
            + (c.kv_lora_rank + c.qk_rope_head_dim) * d + c.kv_lora_rank + c.kv_lora_rank * kv_out * H
            + 2 * c.v_head_dim * H * d)


def expert_params(c: ModelConfig) -> int:
    return 3 * c.latent_size * c.moe_intermediate_size


def moe_fixed_params(c: ModelConfig) -> int:
    d, E, ell = c.hidden_size, c.num_experts, c.latent_size
    return E * d + E + 2 * d * ell + ell + 3 * d * c.num_shared_experts * c.moe_intermediate_size


def count_params(c: ModelConfig) -> ParamCounts:
    d, L = c.hidden_size, c.num_layers
    n_mla = sum(c.is_mla(i) for i in range(L))
    n_moe = sum(c.is_moe(i) for i in range(L))
    n_dense = L - n_moe
    total = (2 * c.vocab_size * d + 3 * d + L * 6 * d
             + (L - n_mla) * kda_params(c) + n_mla * mla_params(c)
             + n_dense * 3 * d * c.dense_intermediate_size
             + n_moe * (moe_fixed_params(c) + c.num_experts * expert_params(c)))
    active = total - c.vocab_size * d - n_moe * (c.num_experts - c.num_experts_per_token) * expert_params(c)
    return ParamCounts(total=total, active=active)
