"""Gated NoPE Multi-head Latent Attention (K3_SPEC.md §2.3).

Per token x ∈ R^d, heads H (local to this TP rank):

    q        = W_qb · RMSNorm(W_qa x)               per head [nope | extra]   [H, n+r]
    [c | k_r] = W_kva x                             c ∈ R^{kv_lora}, k_r ∈ R^r (shared by heads)
    [k_n | v] = W_kvb · RMSNorm(c)                  per head [n | v]          [H, n+v]
    k^h      = [k_n^h ; k_r]                        no rotary embedding anywhere
    o        = softmax(q kᵀ / √(n+r), causal within each document) · v     (fp32 output;
                                                     document_attention.py)
    y        = W_o (o ⊙ σ(W_g x))

Under context parallelism (``docs.shard``) the queries are this rank's share of the rows and the
keys and values the whole rows: the ranks all-gather the compressed latent [c | k_r]
(kv_lora + r values per token, 576 at K3 dims, instead of H·(n+r+v) expanded ones) and each
expands it; NoPE means no position offsets to fix up, only the causal-and-same-document mask
at the local tokens' global positions.

``max_logit`` [H] holds the running per-head maximum of the pre-softmax logits when
``track_max_logit`` is set (QK-clip reads and resets it), from ``kernels.max_logit`` (on CUDA one
Triton launch that keeps no score tensor), with no gradient. With ``qk_clip_tau`` = τ set as well, a
head whose attention kernel's log-sum-exp bound (``attend_with_lse_bound``: m_h ≤ bound ≤ m_h + log T)
is under τ − ``BOUND_MARGIN`` keeps the bound instead (no clip can follow from it), and the exact
kernel runs only for the others (none while every bound stays under τ).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3train.config.schema import ModelConfig
from k3train.model.document_attention import allowed, attend, attend_with_lse_bound
from k3train.model.documents import Documents
from k3train.model.norm import RMSNorm
from k3train.model.replay import replaying
from k3train.parallel.tensor_parallel import TPSpec
from kernels.max_logit import max_logit

#: how far under τ a head's log-sum-exp bound must lie to stand in for its exact max logit: the bound and
#: the exact kernel sum the same products in different orders (a few fp32 ulp of |logit| ≲ 1e-3 apart)
BOUND_MARGIN = 0.01


class GatedMLA(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        self.tp = tp
        d = cfg.hidden_size
        heads = cfg.mla_num_heads
        self.num_heads = tp.local(heads, "model.mla_num_heads")
        self.qk_nope_head_dim = n = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = r = cfg.qk_rope_head_dim
        self.v_head_dim = v = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = 1.0 / math.sqrt(n + r)

        what = "model.mla_num_heads"
        self.q_a_proj = tp.replicated(d, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = tp.column(cfg.q_lora_rank, heads * (n + r), what=what, head_group="mla_q_b", head_dim=n + r)
        self.kv_a_proj = tp.replicated(d, cfg.kv_lora_rank + r)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = tp.column(cfg.kv_lora_rank, heads * (n + v), what=what, head_group="mla_kv_b",
                                   head_dim=n + v)
        self.g_proj = tp.column(d, heads * v, what=what)
        self.o_proj = tp.row(heads * v, d, what=what)

        self.track_max_logit = False
        self.qk_clip_tau: float | None = None  # set: the exact max only for heads whose bound reaches τ
        self.register_buffer("max_logit", torch.full((self.num_heads,), float("-inf")), persistent=False)

    def forward(self, x: torch.Tensor, docs: Documents) -> torch.Tensor:
        B, T, _ = x.shape
        H, n, r, v = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, n + r)
        latent = self.kv_a_proj(x)  # [B, T, kv_lora + r]
        if docs.shard is not None:
            latent = docs.shard.gather_sequence(latent)  # the keys of the whole rows
        Tk = latent.shape[1]
        c, k_r = latent.split([self.kv_lora_rank, r], dim=-1)
        k_n, val = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, Tk, H, n + v).split([n, v], dim=-1)
        k_r = self.tp.copy_to_tp(k_r)  # shared by this rank's heads: its gradient is a TP partial sum
        k = torch.cat([k_n, k_r.unsqueeze(2).expand(B, Tk, H, r)], dim=-1)

        q, k, val = (t.transpose(1, 2) for t in (q, k, val))  # [B, H, T, D]

        def dense_mask():
            return allowed(*self._pairs(docs, T)).unsqueeze(1)

        if self.track_max_logit and not replaying():
            o, bound = attend_with_lse_bound(q, k, val, self.scale, docs, dense_mask)
            self._update_max_logit(q, k, docs, bound)
        else:
            o = attend(q, k, val, self.scale, docs, dense_mask)
        o = o.float().transpose(1, 2).reshape(B, T, H * v)
        y = o * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(y.to(x.dtype))

    @staticmethod
    def _pairs(docs: Documents, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query doc ids [B, T], key doc ids [B, T_keys], query positions in the whole row [T]): key j may
        serve query i when j ≤ position_i and both ids agree (causal within one document)."""
        if docs.shard is None:
            return docs.doc_ids, docs.doc_ids, torch.arange(T, device=docs.doc_ids.device)
        return docs.doc_ids, docs.key_doc_ids, docs.query_index

    @torch.no_grad()
    def _update_max_logit(self, q: torch.Tensor, k: torch.Tensor, docs: Documents, bound: torch.Tensor | None) -> None:
        """max over allowed (query, key) pairs of q·k·scale per head (``kernels.max_logit``), or the
        log-sum-exp ``bound`` [H] for heads where it is under τ − ``BOUND_MARGIN`` (module docstring)."""
        pairs = self._pairs(docs, q.shape[2])
        if bound is None or self.qk_clip_tau is None:
            best = max_logit(q, k, *pairs, self.scale)
        else:
            exact = bound >= self.qk_clip_tau - BOUND_MARGIN  # decided on the device: no host sync
            best = torch.where(exact, max_logit(q, k, *pairs, self.scale, heads=exact), bound)
        self.max_logit.copy_(torch.maximum(self.max_logit.to(best.device), best))
