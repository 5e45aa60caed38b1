"""An independent plain-PyTorch Kimi K3 forward that reads the HF state dict directly.

Written from K3_SPEC.md §2 and §4 only, as an outside check of the exporter and of our model: it
imports nothing from ``k3train`` (no model code, no MXFP4 kernels), takes the HF tensor names and
the ``text_config`` field names as they are, and computes everything naively (a per-token
KDA recurrence, dense masked attention, a per-token expert loop).

    logits = reference_logits(tensors, text_config, tokens, position_ids, mm_dtype)   # [B, T, V]

Precision. Every product with a weight matrix takes its operands in ``mm_dtype`` (fp32 by default;
bf16 is how K3 runs) and rounds its output to ``mm_dtype``; everything else is fp32, as K3_SPEC
fixes it: the depth state (P and the bank) and AttnRes (§2.1), norm statistics, the short conv
and the KDA gates and recurrence (§2.2), the MLA attention and its output (§2.3), the router and
SiTU (§2.4). The fp32 tensors of §4 (conv1d, A_log, dt_bias, o_norm, the router bias) are read
in fp32, as is the router matrix.

``position_ids`` [B, T] restart at 0 at each document start (packed sequences); every mixer
then stays inside its document.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

P = "language_model.model."
_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K3_SPEC §4: byte i holds column 2i (low nibble) and 2i+1 (high); bit 3 = sign, bits 0-2 index
    the LUT; W[r, c] = LUT[code] · 2^(scale[r, c // 32] − 127). → fp32 [rows, 2·packed cols]."""
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2).long()  # [rows, cols]
    mag = torch.tensor(_LUT, dtype=torch.float64)[codes & 7]
    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    exp = scale.double().repeat_interleave(32, dim=1) - 127
    return (sign * mag * torch.pow(2.0, exp)).float()


class Weights:
    """The HF tensors by short name: ``w.mat("layers.3.self_attn.o_proj")`` a matrix in the matmul
    dtype, ``w.vec(name, suffix)`` any tensor in fp32."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], mm_dtype: torch.dtype):
        self.t, self.mm_dtype = tensors, mm_dtype

    def mat(self, name: str) -> torch.Tensor:
        return self.t[P + name + ".weight"].to(self.mm_dtype)

    def vec(self, name: str, suffix: str = ".weight") -> torch.Tensor:
        return self.t[P + name + suffix].float()

    def expert(self, base: str) -> torch.Tensor:
        if P + base + ".weight" in self.t:
            return self.mat(base)
        return decode_mxfp4(self.t[P + base + ".weight_packed"], self.t[P + base + ".weight_scale"]).to(self.mm_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] (fp32) @ weightᵀ [in, out] with both operands and the output rounded to the
    weight's dtype; returned in fp32."""
    return (x.to(weight.dtype) @ weight.T).float()


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def attn_res(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """§2.1: Σ_i softmax_i((w⊙γ)·v_i/rms(v_i)) · v_i over the depth sources, rms eps 1e-5."""
    V = torch.stack(sources)  # [S, B, T, d]
    keys = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + 1e-5)
    score = (keys * (query.reshape(-1) * gain)).sum(-1)  # [S, B, T]
    return (torch.softmax(score, dim=0).unsqueeze(-1) * V).sum(0)


def situ(a: torch.Tensor, c: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """Eq. 12: [β·tanh(a/β)·σ(a)] ⊙ [β_lin·tanh(c/β_lin)]."""
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (lin_beta * torch.tanh(c / lin_beta))


def _doc_starts(pos: torch.Tensor) -> torch.Tensor:
    starts = pos == 0
    starts[:, 0] = True
    return starts.long().cumsum(1)  # [B, T] document id within the row


def kda(w: Weights, pre: str, x: torch.Tensor, doc: torch.Tensor, cfg: dict) -> torch.Tensor:
    """§2.2 with the per-token recurrence S_t = (I − β k kᵀ) Diag(α) S_{t−1} + β k vᵀ, o = Sᵀ q/√h."""
    lin = cfg["linear_attn_config"]
    H, h, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    lb, eps = lin["gate_lower_bound"], cfg["rms_norm_eps"]
    B, T, _ = x.shape

    def conv(name: str) -> torch.Tensor:
        y = linear(x, w.mat(f"{pre}.{name}_proj"))  # [B, T, P]
        kern = w.vec(f"{pre}.{name}_conv1d")[:, 0, :]  # [P, K]; tap K-1 multiplies the current token
        out = torch.zeros_like(y)
        for t in range(T):
            for j in range(K):
                s = t - (K - 1 - j)
                if s >= 0:
                    same = (doc[:, s] == doc[:, t]).unsqueeze(-1).to(y.dtype)
                    out[:, t] += same * y[:, s] * kern[:, j]
        return F.silu(out).view(B, T, H, h)

    q, k, v = conv("q"), conv("k"), conv("v")
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    f = linear(linear(x, w.mat(f"{pre}.f_a_proj")), w.mat(f"{pre}.f_b_proj")).view(B, T, H, h)
    A = w.vec(pre + ".A_log", "")[:H]
    dt_bias = w.vec(pre + ".dt_bias", "").view(H, h)
    alpha = torch.exp(lb * torch.sigmoid(torch.exp(A).view(H, 1) * (f + dt_bias)))  # [B, T, H, h]
    beta = torch.sigmoid(linear(x, w.mat(f"{pre}.b_proj")))  # [B, T, H]
    o = torch.zeros(B, T, H, h, dtype=x.dtype)
    eye = torch.eye(h, dtype=x.dtype)
    for b in range(B):
        S = torch.zeros(H, h, h, dtype=x.dtype)
        for t in range(T):
            if t == 0 or doc[b, t] != doc[b, t - 1]:
                S = torch.zeros_like(S)
            kt, vt, bt = k[b, t], v[b, t], beta[b, t].view(H, 1, 1)
            decayed = alpha[b, t].unsqueeze(-1) * S  # Diag(α) S: row i scaled by α_i
            S = (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)) @ decayed + bt * kt.unsqueeze(-1) * vt.unsqueeze(-2)
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t] / math.sqrt(h))
    y = rms_norm(o, w.vec(pre + ".o_norm"), eps) * torch.sigmoid(linear(x, w.mat(f"{pre}.g_proj"))).view(B, T, H, h)
    return linear(y.reshape(B, T, H * h), w.mat(f"{pre}.o_proj"))


def mla(w: Weights, pre: str, x: torch.Tensor, doc: torch.Tensor, cfg: dict) -> torch.Tensor:
    """§2.3: gated NoPE MLA, causal softmax within each document, scale 1/√(n+r)."""
    H, n, r, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_rank, eps = cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    B, T, _ = x.shape
    q = linear(rms_norm(linear(x, w.mat(f"{pre}.q_a_proj")), w.vec(f"{pre}.q_a_layernorm"), eps),
               w.mat(f"{pre}.q_b_proj")).view(B, T, H, n + r)
    ckr = linear(x, w.mat(f"{pre}.kv_a_proj_with_mqa"))
    c, k_r = ckr[..., :kv_rank], ckr[..., kv_rank:]
    kv = linear(rms_norm(c, w.vec(f"{pre}.kv_a_layernorm"), eps), w.mat(f"{pre}.kv_b_proj")).view(B, T, H, n + dv)
    k = torch.cat([kv[..., :n], k_r.unsqueeze(2).expand(B, T, H, r)], dim=-1)
    v = kv[..., n:]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(n + r)
    idx = torch.arange(T)
    allowed = (idx.view(1, T, 1) >= idx.view(1, 1, T)) & (doc.unsqueeze(2) == doc.unsqueeze(1))  # [B, q, k]
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v).reshape(B, T, H * dv)
    return linear(o * torch.sigmoid(linear(x, w.mat(f"{pre}.g_proj"))), w.mat(f"{pre}.o_proj"))


def glu_mlp(w: Weights, pre: str, x: torch.Tensor, cfg: dict) -> torch.Tensor:
    a, c = linear(x, w.mat(f"{pre}.gate_proj")), linear(x, w.mat(f"{pre}.up_proj"))
    y = situ(a, c, cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"])
    return linear(y, w.mat(f"{pre}.down_proj"))


def latent_moe(w: Weights, pre: str, x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """§2.4: sigmoid router with a selection-only bias, latent experts, routed RMSNorm, shared MLP."""
    k = cfg["num_experts_per_token"]
    flat = x.reshape(-1, x.shape[-1])
    s = torch.sigmoid(flat @ w.vec(f"{pre}.gate").T)
    chosen = (s + w.vec(f"{pre}.gate.e_score_correction_bias", "")).topk(k, dim=-1).indices
    p = s.gather(1, chosen)
    p = p / p.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    z = linear(flat, w.mat(f"{pre}.routed_expert_down_proj"))
    u = torch.zeros_like(z)
    beta, lin = cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"]
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        w1, w3, w2 = (w.expert(f"{pre}.experts.{e}.{m}") for m in ("w1", "w3", "w2"))
        ze = z[rows]
        u.index_add_(0, rows, p[rows, slot].unsqueeze(-1) * linear(situ(linear(ze, w1), linear(ze, w3), beta, lin), w2))
    routed = linear(rms_norm(u, w.vec(f"{pre}.routed_expert_norm"), cfg["rms_norm_eps"]),
                    w.mat(f"{pre}.routed_expert_up_proj"))
    return (glu_mlp(w, f"{pre}.shared_experts", flat, cfg) + routed).view_as(x)


@torch.no_grad()
def reference_logits(tensors: Mapping[str, torch.Tensor], cfg: dict, tokens: torch.Tensor,
                     position_ids: torch.Tensor | None = None, mm_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HF tensors + HF ``text_config`` dict + tokens [B, T] → fp32 logits [B, T, V] (§2.1 skeleton)."""
    w = Weights(tensors, mm_dtype)
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    doc = _doc_starts(position_ids.clone())
    eps, S = cfg["rms_norm_eps"], cfg["attn_res_block_size"]
    mla_layers = {i - 1 for i in cfg["linear_attn_config"]["full_attn_layers"]}
    partial = w.mat("embed_tokens")[tokens].float()
    bank: list[torch.Tensor] = []
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"layers.{layer}"
        x_a = rms_norm(attn_res(bank + [partial], w.vec(f"{pre}.self_attention_res_proj"),
                                w.vec(f"{pre}.self_attention_res_norm")), w.vec(f"{pre}.input_layernorm"), eps)
        if layer % S == 0:
            bank, partial = bank + [partial], torch.zeros_like(partial)
        mixer = mla if layer in mla_layers else kda
        partial = partial + mixer(w, f"{pre}.self_attn", x_a, doc, cfg)
        x_m = rms_norm(attn_res(bank + [partial], w.vec(f"{pre}.mlp_res_proj"), w.vec(f"{pre}.mlp_res_norm")),
                       w.vec(f"{pre}.post_attention_layernorm"), eps)
        if layer < cfg["first_k_dense_replace"]:
            partial = partial + glu_mlp(w, f"{pre}.mlp", x_m, cfg)
        else:
            partial = partial + latent_moe(w, f"{pre}.block_sparse_moe", x_m, cfg)
    h = rms_norm(attn_res(bank + [partial], w.vec("output_attn_res_proj"), w.vec("output_attn_res_norm")),
                 w.vec("norm"), eps)
    return linear(h, tensors["language_model.lm_head.weight"].to(mm_dtype))
