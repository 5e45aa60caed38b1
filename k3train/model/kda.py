"""Kimi Delta Attention layer (K3_SPEC.md §2.2).

Per token x ∈ R^d, heads H (local to this TP rank), head dim h, P = H·h:

    q̃, k̃, ṽ = W_q x, W_k x, W_v x                      (column-parallel, [P] each)
    q, k, v  = SiLU(causal_conv4(·))                   (depthwise, resets at document starts;
                                                         ``kernels.short_conv``)
    f        = W_fb W_fa x                             (low rank d → h → P)
    g        = lb · σ(exp(A_log) · (f + dt_bias))       (log-decay in (lb, 0); inside the kernel)
    β        = σ(W_b x)                                 ([H]; inside the kernel)
    S_t      = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ,  o_t = S_tᵀ q_t / √h
    y        = W_o · flatten(RMSNorm_w(o) ⊙ σ(W_g x))   (row-parallel)

q and k are L2-normalised per head inside the kernel. The recurrence runs in
``kernels.kda`` (Triton on GPU, a chunked PyTorch reference on CPU). Under context parallelism
(``docs.shard``) the conv takes its halo and the recurrence its entering state from the chunks
before (``k3train.parallel.context_parallel``).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from kernels.kda import kda as kda_op, known_offsets
from kernels.short_conv import causal_conv_with_resets
from k3train.config.schema import ModelConfig
from k3train.model.documents import Documents
from k3train.model.norm import rms_norm
from k3train.model.roles import Kind, ParamRole, set_role
from k3train.parallel.context_parallel import causal_conv_context_parallel, kda_context_parallel
from k3train.parallel.tensor_parallel import TPSpec


def init_dt_bias(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """dt ~ logU(1e-3, 1e-1), clamped ≥ 1e-4, stored as its inverse softplus dt + log(−expm1(−dt))."""
    u = torch.rand(n, generator=generator)
    dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    """KDA mixer. Input/output [B, T, d]; heads sharded over TP."""

    #: The recurrence kernel of the single-device path (``kernels.kda.kda``). It exists so that a
    #: benchmark or test can swap in a reference kernel on one mixer (``mixer.kernel = f``, an instance
    #: attribute; the class default stays) without patching a module global. ``f`` takes ``kda``'s
    #: signature, ``f(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, cu_seqlens, use_qk_l2norm, ...)``,
    #: and returns ``(o, final_state)`` (``final_state`` may be None: the mixer does not read it). The
    #: context-parallel path (``docs.shard``) does not use it.
    kernel = staticmethod(kda_op)

    def __init__(self, cfg: ModelConfig, tp: TPSpec):
        super().__init__()
        self.tp = tp
        d, h = cfg.hidden_size, cfg.kda_head_dim
        heads = cfg.kda_num_heads
        P = heads * h
        self.head_dim = h
        self.num_heads = tp.local(heads, "model.kda_num_heads")
        self.lower_bound = cfg.kda_gate_lower_bound
        self.eps = cfg.rms_norm_eps

        what = "model.kda_num_heads*kda_head_dim"
        self.q_proj = tp.column(d, P, what=what, head_group="kda_qkv", head_dim=h)
        self.k_proj = tp.column(d, P, what=what, head_group="kda_qkv", head_dim=h)
        self.v_proj = tp.column(d, P, what=what, head_group="kda_qkv", head_dim=h)
        self.g_proj = tp.column(d, P, what=what)
        self.f_a_proj = tp.replicated(d, h)
        self.f_b_proj = tp.column(h, P, what=what)
        self.b_proj = tp.column(d, heads, what="model.kda_num_heads")
        self.o_proj = tp.row(P, d, what=what)

        def sharded(full: torch.Tensor, kind: Kind) -> nn.Parameter:
            return set_role(nn.Parameter(tp.shard(full, 0)), ParamRole(kind, tp_partition_dim=0, keep_fp32=True))

        conv_std = 1.0 / math.sqrt(cfg.kda_conv_size)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            full = torch.empty(P, 1, cfg.kda_conv_size).uniform_(-conv_std, conv_std)
            setattr(self, name, sharded(full, Kind.CONV))
        self.A_log = sharded(torch.zeros(heads), Kind.GATE_PARAM)
        self.dt_bias = sharded(init_dt_bias(P), Kind.GATE_PARAM)
        # One head-wise RMSNorm gain shared by all heads (replicated under TP). The spec keeps the conv
        # weights, A_log, dt_bias and o_norm in fp32, also when the other parameters are bf16.
        self.o_norm = set_role(nn.Parameter(torch.ones(h)), ParamRole(Kind.NORM, keep_fp32=True))

    def forward(self, x: torch.Tensor, docs: Documents) -> torch.Tensor:
        B, T, _ = x.shape
        H, h = self.num_heads, self.head_dim
        pos, shard = docs.position_ids, docs.shard

        def conv(projected: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            """The conv and its SiLU in one kernel, [B, T, P] → [B, T, H, h] contiguous."""
            if shard is None:
                out = causal_conv_with_resets(projected, weight, pos, silu=True)
            else:
                out = causal_conv_context_parallel(projected, weight, pos, shard,
                                                   partial(causal_conv_with_resets, silu=True))
            return out.view(B, T, H, h)

        # one conv each: its output is the kernel's contiguous input, no concatenation or copy either way
        q = conv(self.q_proj(x), self.q_conv1d)
        k = conv(self.k_proj(x), self.k_conv1d)
        v = conv(self.v_proj(x), self.v_conv1d)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, h)
        b = self.b_proj(x).view(B, T, H)
        A_log, dt_bias = self.A_log.float(), self.dt_bias.float()
        if shard is not None:
            o = kda_context_parallel(q, k, v, f, b, A_log, dt_bias, docs.pieces, shard, lower_bound=self.lower_bound)
        else:
            # One document per row: the rows as they are. Else the batch packed into one row, so that
            # the kernel resets its state at every document start.
            rows, cu_seqlens = (B, None) if docs.one_per_row else (1, docs.cu_seqlens)
            # compiling is tested first: dynamo then never reads the host offsets (a guard on their count)
            if not torch.compiler.is_compiling() and cu_seqlens is not None and docs.offsets is not None:
                known_offsets(cu_seqlens, docs.offsets)  # counted on the host: the kernel's check reads nothing back

            def flat(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(rows, B * T // rows, *t.shape[2:]).contiguous()

            o, _ = self.kernel(flat(q), flat(k), flat(v), flat(f), flat(b), A_log, dt_bias,
                               lower_bound=self.lower_bound, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
            o = o.view(B, T, H, h)
        # y = RMSNorm(o)·γ·σ(g_proj x) per head, in fp32 until the one rounding to x's dtype (one kernel)
        gate = self.g_proj(x).view(B, T, H, h)
        y = rms_norm(o, self.tp.copy_to_tp(self.o_norm), self.eps, x.dtype, gate=gate)
        return self.o_proj(y.reshape(B, T, H * h))
