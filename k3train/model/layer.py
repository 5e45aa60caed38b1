"""One K3 decoder layer with Block AttnRes (K3_SPEC.md §2.1).

State carried across layers: the block bank B (list of [B, T, d]) and the partial sum P, both
fp32 (K3_SPEC §2.1; in bf16 the token-specific part of P, small next to the shared part early in
training, is rounded away before the router sees it: docs/moe_notes.md).
For layer l with block size S:

    x_a = RMSNorm_in(Agg_attn(B ∪ [P]))
    if l % S == 0:  B.append(P); P = 0         (block write)
    P  += Attn_l(x_a)
    x_m = RMSNorm_post(Agg_mlp(B ∪ [P]))
    P  += FFN_l(x_m)

Each ``P += branch`` is done by the AttnRes site that reads P next (``residual=``, fused in its kernels):
Attn_l's by this layer's mlp site, FFN_l's by the next layer's attention site (or the output site), so a
layer returns P without its FFN output, and that output as ``pending`` (its caller passes it on).
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.model.attn_res import AttnResAggregator
from k3train.model.documents import Documents
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.model.mlp import SiTUMLP
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.parallel.tensor_parallel import TPSpec


class K3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPSpec, layer_idx: int):
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.writes_block = layer_idx % cfg.attn_res_block_size == 0
        self.self_attention_res = AttnResAggregator(d)
        # The norms' outputs feed only GEMMs, except the MoE router's fp32 scores (K3_SPEC §2.3).
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, autocast_output=True)
        self.self_attn = GatedMLA(cfg, tp) if cfg.is_mla(layer_idx) else KimiDeltaAttention(cfg, tp)
        self.mlp_res = AttnResAggregator(d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, autocast_output=not cfg.is_moe(layer_idx))
        if cfg.is_moe(layer_idx):
            self.mlp = LatentMoE(cfg, tp)
        else:
            self.mlp = SiTUMLP(tp, d, cfg.dense_intermediate_size, cfg.situ_beta, cfg.situ_linear_beta)

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor, docs: Documents,
                pending: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(B, P, pending) → (B', P', pending'): the running sum is P + pending (pending: the previous
        layer's FFN output, or None), and this layer's own FFN output comes back as pending'."""
        # every site passes all its sources on (AttnResAggregator): their gradients add up in its backward
        x_a, (*bank, partial) = self.self_attention_res([*bank, partial], self.input_layernorm, len(bank) + 1,
                                                        residual=pending)
        if self.writes_block:
            bank, partial, branch = [*bank, partial], self.self_attn(x_a, docs).float(), None
        else:  # P + Attn(x_a) is formed by the site that reads it (fp32 + bf16 → fp32, exact)
            branch = self.self_attn(x_a, docs)
        x_m, (*bank, partial) = self.mlp_res([*bank, partial], self.post_attention_layernorm, len(bank) + 1,
                                             residual=branch)
        return bank, partial, self.mlp(x_m)
