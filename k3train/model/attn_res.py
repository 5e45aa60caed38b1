"""Block Attention Residuals (K3_SPEC.md §2.1, K3 report Eq. 8–10).

There is no residual stream. Each aggregation site mixes a list of depth sources
v_i ∈ R^d (the block bank plus the running partial sum) with a softmax over sources:

    Agg(V) = Σ_i softmax_i( (w ⊙ γ) · v_i / rms(v_i) ) · v_i,   rms(v) = √(mean(v²) + 1e-5)

w ([1, d], the pseudo-query) starts at 0 so the initial mix is uniform; γ ([d]) is a
key-norm gain starting at 1. No 1/√d scaling; the weighted sum is over the raw v_i; fp32.
The op is ``kernels.attn_res.attn_res_rms_norm`` (reference, Triton forward/backward).

Every site reads its mix through an RMSNorm (x_a = RMSNorm_in(Agg), x_m = RMSNorm_post(Agg),
h = RMSNorm_final(Agg_out)); the aggregator applies the norm it is given, fused into the same
kernels (``kernels.attn_res.attn_res_rms_norm``: Agg is never written), so that one call is the
whole site, the unit that activation recompute (``train.recompute=attn_res``) replays.

A site passes on the sources that later sites read again (``pass_through``), so that the fp32
gradients of a bank row or of P are summed inside the sites' backward kernels, each adding what
came from later into its own, rather than by autograd between them (docs/kernels_attn_res.md).
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role
from k3train.model.norm import RMSNorm
from kernels.attn_res import attn_res_site


class AttnResAggregator(nn.Module):
    """One aggregation site: ``proj`` is the pseudo-query w [1, d], ``norm`` the key-norm gain γ [d]."""

    def __init__(self, dim: int):
        super().__init__()
        # fp32 also with bf16 parameters: the aggregation is fp32 (w ⊙ γ is formed in fp32), so a bf16 copy
        # would cost two casts forward and two backward per site
        self.proj = set_role(nn.Parameter(torch.zeros(1, dim)), ParamRole(Kind.PSEUDO_QUERY, keep_fp32=True))
        self.norm = set_role(nn.Parameter(torch.ones(dim)), ParamRole(Kind.NORM, keep_fp32=True))

    def forward(self, sources: list[torch.Tensor], out_norm: RMSNorm, pass_through: int = 0,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """S sources [B, T, d] → (out_norm(Agg(sources)) [B, T, d], the last ``pass_through`` sources
        passed through the site: later readers read these, so the site's backward kernel adds their
        gradients to its own; ``kernels.attn_res.attn_res_site``). With ``residual`` the last source is
        sources[-1] + residual (P + a branch's output), added by the site and passed on in its place."""
        return attn_res_site(sources, self.proj, self.norm, out_norm.weight, out_norm.eps,
                             out_norm.output_dtype(sources[0]), pass_through, residual=residual)
