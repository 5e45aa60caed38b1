"""Plain-torch Block AttnRes aggregation (K3_SPEC.md §2.1): the forward and its analytic backward.

For one token, sources v_i ∈ R^d (i < S), pseudo-query w [d] and key-norm gain γ [d], q̃ = w ⊙ γ::

    r_i = (mean(v_i²) + ε)^(-1/2),   k_i = r_i v_i,   l_i = k_i · q̃,   a = softmax_i(l),
    out = Σ_i a_i v_i                                               (ε = 1e-5)

Backward, with g = ∂L/∂out, c_i = g · v_i, p_i = q̃ · v_i::

    dl_i = a_i (c_i − Σ_j a_j c_j)
    dv_i = a_i g + dl_i r_i q̃ − dl_i (r_i³ / d) p_i v_i
    dq̃  = Σ_tokens Σ_i dl_i k_i,    dw = dq̃ ⊙ γ,    dγ = dq̃ ⊙ w

Math is in fp32 (float64 inputs stay float64, for tests); outputs are in the sources' dtype.
"""

from __future__ import annotations

import torch

RMS_EPS = 1e-5


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def attn_res_forward(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """Softmax-over-depth mix of ``sources`` (S tensors [..., d]) with ``query`` (w, d elements,
    e.g. [1, d]) and ``gain`` (γ [d]) → [..., d] in the sources' dtype; differentiable."""
    ct = _compute_dtype(sources[0])
    V = torch.stack(sources, dim=0).to(ct)  # [S, ..., d]
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    logits = (keys * (query.to(ct).view(-1) * gain.to(ct))).sum(-1)  # [S, ...]
    weights = torch.softmax(logits, dim=0).unsqueeze(-1)
    return (weights * V).sum(0).to(sources[0].dtype)


def attn_res_backward(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                      grad_out: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(dv_i for each source, dw in query's shape, dγ [d]) from the formulas above, in the
    compute dtype; what the Triton backward implements."""
    ct = _compute_dtype(sources[0])
    V = torch.stack(sources, dim=0).to(ct)  # [S, ..., d]
    g = grad_out.to(ct)
    w, gam = query.to(ct).view(-1), gain.to(ct)
    qt = w * gam
    r = torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + RMS_EPS)  # [S, ..., 1]
    p = (V * qt).sum(-1, keepdim=True)
    a = torch.softmax(r * p, dim=0)
    c = (V * g).sum(-1, keepdim=True)
    dl = a * (c - (a * c).sum(0, keepdim=True))
    dV = a * g + dl * r * qt - dl * r.pow(3) * p / V.shape[-1] * V
    dqt = (dl * r * V).reshape(-1, V.shape[-1]).sum(0)
    return list(dV.unbind(0)), (dqt * gam).view(query.shape), dqt * w
