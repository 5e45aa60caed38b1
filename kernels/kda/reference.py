"""Plain-PyTorch references for K3 Kimi Delta Attention (KDA).

Two references with K3 semantics (K3_SPEC.md section 2.2):

* :func:`kda_recurrent` -- token-by-token recurrence, fp32 or fp64.  Slow; the
  ground truth for tests.
* :func:`kda_chunked` -- chunkwise form with exact pairwise decays, plain torch
  ops (differentiable by autograd).  This is the CPU training path.

Both take raw inputs: the gate input ``g`` (before activation), the beta logits,
``A_log`` and ``dt_bias``; the activation, L2 norm and sigmoid happen here.

Per head, with S of shape [K, V]:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(gate_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

L2_EPS = 1e-6
REF_CHUNK = 16


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gate = lower_bound * sigmoid(exp(A_log)[h] * (g + dt_bias)); shape of g, in (lower_bound, 0)."""
    H, K = g.shape[-2], g.shape[-1]
    a = torch.exp(A_log.to(dtype)).view(H, 1)
    x = a * (g.to(dtype) + dt_bias.to(dtype).view(H, K))
    return lower_bound * torch.sigmoid(x)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, dtype):
    K = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    q = q.to(dtype)
    k = k.to(dtype)
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    q = q * scale
    gate = kda_gate(g, A_log, dt_bias, lower_bound, dtype)
    b = torch.sigmoid(beta.to(dtype))
    return q, k, v.to(dtype), gate, b


def _seq_bounds(B, T, cu_seqlens):
    """List of (batch index, start, end) per sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def kda_recurrent(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
                  initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm=True, dtype=torch.float32):
    """Naive token-by-token recurrence (the ground truth). Differentiable."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gate, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                    use_qk_l2norm, dtype)
    outs = []
    finals = []
    for n, (b, s, e) in enumerate(_seq_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = qf.new_zeros(H, K, V)
        o_seq = []
        for t in range(s, e):
            S = S * torch.exp(gate[b, t])[..., None]                      # D_t S
            kt = kf[b, t]                                                   # [H, K]
            pred = torch.einsum("hkv,hk->hv", S, kt)
            S = S + torch.einsum("hk,hv->hkv", kt, bf[b, t][:, None] * (vf[b, t] - pred))
            o_seq.append(torch.einsum("hkv,hk->hv", S, qf[b, t]))
        outs.append(torch.stack(o_seq, 0) if o_seq else qf.new_zeros(0, H, V))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs, 0)
    else:
        o = torch.cat(outs, 0)[None]
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(v.dtype), (final.float() if final is not None else None)


def _chunked_one(q, k, v, gate, b, S, C):
    """One sequence, all heads. q,k,gate [T,H,K]; v [T,H,V]; b [T,H]; S [H,K,V]."""
    T, H, K = q.shape
    V = v.shape[-1]
    NT = (T + C - 1) // C
    pad = NT * C - T
    if pad:
        # padded rows are no-ops: k = v = q = 0, beta = 0, gate = 0 (no decay)
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, 0, 0, pad))
        gate = F.pad(gate, (0, 0, 0, 0, 0, pad))
        b = F.pad(b, (0, 0, 0, pad))
    # -> [H, NT, C, *]
    q = q.view(NT, C, H, K).permute(2, 0, 1, 3)
    k = k.view(NT, C, H, K).permute(2, 0, 1, 3)
    v = v.view(NT, C, H, V).permute(2, 0, 1, 3)
    gate = gate.view(NT, C, H, K).permute(2, 0, 1, 3)
    b = b.view(NT, C, H).permute(2, 0, 1)
    G = gate.cumsum(2)                                              # [H,NT,C,K]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.clone().fill_diagonal_(False)
    # Pairwise decays exp(G_r - G_s) through the chunk's middle row: each factor is at most
    # exp(C/2 * |lower_bound|) (= e^40 at C = 16, bound -5), so plain matmuls stay exact.
    ref = G[..., C // 2 - 1:C // 2, :]
    Qi = q * torch.exp(G - ref)
    Ki = k * torch.exp(G - ref)
    Kh = k * torch.exp(ref - G)
    Mqk = (Qi @ Kh.transpose(-1, -2)).masked_fill(~incl, 0.0)      # r >= s
    Akk = (Ki @ Kh.transpose(-1, -2)).masked_fill(~strict, 0.0) * b[..., :, None]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    X = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False,
                                      unitriangular=True)
    Tm = X * b[..., None, :]                                        # (I+A)^-1 Diag(beta)
    Gl = G[..., -1:, :]                                             # [H,NT,1,K]
    Qd = q * torch.exp(G)
    Kd = k * torch.exp(G)
    Ke = k * torch.exp(Gl - G)
    Wk = Tm @ Kd                                                    # [H,NT,C,K]
    U = Tm @ v                                                      # [H,NT,C,V]
    decay = torch.exp(Gl[..., 0, :])                                # [H,NT,K]
    outs = []
    for n in range(NT):
        W = U[:, n] - Wk[:, n] @ S
        outs.append(Qd[:, n] @ S + Mqk[:, n] @ W)
        S = decay[:, n, :, None] * S + Ke[:, n].transpose(-1, -2) @ W
    o = torch.stack(outs, 1).reshape(H, NT * C, V).permute(1, 0, 2)[:T]
    return o, S


def kda_chunked(q, k, v, g, beta, A_log, dt_bias, *, lower_bound=-5.0, scale=None,
                initial_state=None, output_final_state=False, cu_seqlens=None,
                use_qk_l2norm=True, chunk_size=REF_CHUNK, dtype=None):
    """Chunkwise KDA in plain torch (autograd-differentiable); the CPU path.

    Intra-chunk decays exp(G_r - G_s) go through a mid-chunk reference point, exact for
    lower_bound >= -5 with the default 16-token chunk (factors <= e^40).  Computes in
    fp32 (fp64 if q is fp64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if dtype is None:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, gate, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                    use_qk_l2norm, dtype)
    outs, finals = [], []
    for n, (bi, s, e) in enumerate(_seq_bounds(B, T, cu_seqlens)):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = qf.new_zeros(H, K, V)
        if e > s:
            o, S = _chunked_one(qf[bi, s:e], kf[bi, s:e], vf[bi, s:e], gate[bi, s:e],
                                bf[bi, s:e], S, chunk_size)
        else:
            o = qf.new_zeros(0, H, V)
        outs.append(o)
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs, 0)
    else:
        o = torch.cat(outs, 0)[None]
    final = torch.stack(finals, 0).float() if output_final_state else None
    return o.to(v.dtype), final
