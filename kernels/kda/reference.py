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


def _chunk_layout(B, T, C, seqs, device):
    """Token index of every chunk row (pad rows -> B*T, an appended zero row), the chunk
    ids per (sequence, chunk position) (pad -> NC, an appended identity chunk), and the
    output row of every token."""
    pad_tok = B * T
    tok_rows, chunk_ids, out_rows = [], [], []
    nc = 0
    nmax = max((e - s + C - 1) // C for _, s, e in seqs)
    for n, (b, s, e) in enumerate(seqs):
        L = e - s
        nch = (L + C - 1) // C
        pos = torch.arange(nch * C)
        tok = b * T + s + pos
        tok_rows.append(torch.where(pos < L, tok, torch.full_like(tok, pad_tok)).view(nch, C))
        chunk_ids.append(list(range(nc, nc + nch)) + [None] * (nmax - nch))
        out_rows.append(n * nmax * C + torch.arange(L))
        nc += nch
    tok_idx = torch.cat(tok_rows, 0).to(device)                   # [NC, C]
    steps = [torch.tensor([ids[j] if ids[j] is not None else nc for ids in chunk_ids],
                          device=device) for j in range(nmax)]
    return tok_idx, steps, torch.cat(out_rows).to(device), nc, nmax


def _chunked_all(q, k, v, gate, b, S, C, seqs):
    """All sequences at once. q,k,gate [B,T,H,K]; v [B,T,H,V]; b [B,T,H]; S [N,H,K,V].

    Intra-chunk work runs on the flat list of every sequence's chunks; the state
    recurrence steps over chunk positions with all sequences in a batch (shorter ones
    step through an identity chunk)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = len(seqs)
    tok_idx, steps, out_rows, NC, nmax = _chunk_layout(B, T, C, seqs, q.device)

    def gather(x):  # [B,T,H,*] -> [H, NC, C, *] with zero pad rows
        flat = x.reshape(B * T, *x.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])], 0)
        g = flat[tok_idx]                                           # [NC, C, H, *]
        return g.movedim(2, 0)

    q, k, v, gate, b = gather(q), gather(k), gather(v), gather(gate), gather(b)
    G = gate.cumsum(2)                                              # [H,NC,C,K]
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
    Gl = G[..., -1:, :]                                             # [H,NC,1,K]
    Qd = q * torch.exp(G)
    Kd = k * torch.exp(G)
    Ke = k * torch.exp(Gl - G)
    Wk = Tm @ Kd                                                    # [H,NC,C,K]
    U = Tm @ v                                                      # [H,NC,C,V]
    decay = torch.exp(Gl[..., 0, :])                                # [H,NC,K]

    def ext(x, fill):  # append the identity chunk (index NC), then chunk-major
        pad = torch.full_like(x[:, :1], fill)
        return torch.cat([x, pad], 1).movedim(1, 0)                 # [NC+1, H, ...]

    U, Wk, Qd, Mqk, Ke, decay = (ext(U, 0.), ext(Wk, 0.), ext(Qd, 0.), ext(Mqk, 0.),
                                 ext(Ke, 0.), ext(decay, 1.))
    outs = []
    for c in steps:                                                 # c: [N] chunk ids
        W = U[c] - Wk[c] @ S                                        # [N,H,C,V]
        outs.append(Qd[c] @ S + Mqk[c] @ W)
        S = decay[c][..., None] * S + Ke[c].transpose(-1, -2) @ W
    o = torch.stack(outs, 1)                                        # [N,nmax,H,C,V]
    o = o.permute(0, 1, 3, 2, 4).reshape(N * nmax * C, H, V)[out_rows]
    return o.view(B, T, H, V), S


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
    seqs = _seq_bounds(B, T, cu_seqlens)
    if initial_state is not None:
        S = initial_state.to(dtype)
    else:
        S = qf.new_zeros(len(seqs), H, K, V)
    o, S = _chunked_all(qf, kf, vf, gate, bf, S, chunk_size, seqs)
    final = S.float() if output_final_state else None
    return o.to(v.dtype), final
