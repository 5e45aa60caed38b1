"""Small stand-in modules with declared roles, used until (and beside) the real K3 model.

``StandInModel`` holds one parameter of every treatment the optimizer distinguishes:
per-head column-parallel matrices (two head groups), whole matrices (column-parallel,
row-parallel, replicated; one with interleaved gate/up rows), expert stacks (one with
interleaved gate/up rows), and AdamW parameters with and without weight decay.
``tp_rank/tp_size`` build the local shards of the same full tensors, so a TP run can be
compared with a 1-rank run on the full model.
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.model.roles import Kind, ParamRole, set_role

# name -> (full shape, role)
SPECS: dict[str, tuple[tuple[int, ...], ParamRole]] = {
    "emb": ((50, 16), ParamRole(Kind.EMBEDDING)),
    "q": ((4 * 8, 16), ParamRole(Kind.MATRIX, "kda_qkv", 8, 0)),
    "k": ((4 * 8, 16), ParamRole(Kind.MATRIX, "kda_qkv", 8, 0)),
    "q_b": ((4 * 12, 10), ParamRole(Kind.MATRIX, "mla_q_b", 12, 0)),
    "kv_b": ((4 * 16, 6), ParamRole(Kind.MATRIX, "mla_kv_b", 16, 0)),
    "g": ((32, 16), ParamRole(Kind.MATRIX, None, None, 0)),
    "gate_up": ((2 * 12, 16), ParamRole(Kind.MATRIX, None, None, 0, row_interleave=2)),  # rows gate_j, up_j
    "o": ((16, 32), ParamRole(Kind.MATRIX, None, None, 1)),
    "f_a": ((6, 16), ParamRole(Kind.MATRIX)),
    "f_b": ((32, 6), ParamRole(Kind.MATRIX)),
    "experts_w1": ((4, 12, 16), ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=1)),
    "experts_w13": ((4, 2 * 12, 16), ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=1, row_interleave=2)),
    "v": ((4 * 8, 16), ParamRole(Kind.MATRIX, "kda_qkv", 8, 1)),  # per-head but row-sharded: gathered
    "experts_w2": ((4, 16, 12), ParamRole(Kind.EXPERT_MATRIX, tp_partition_dim=2)),
    "norm": ((16,), ParamRole(Kind.NORM)),
    "conv": ((32, 1, 4), ParamRole(Kind.CONV)),
    "dt_bias": ((32,), ParamRole(Kind.GATE_PARAM)),
    "lm_head": ((50, 16), ParamRole(Kind.LM_HEAD)),
}


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, (shape, _) in SPECS.items()}


def shard(name: str, t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    role = SPECS[name][1]
    dim = role.tp_partition_dim
    if tp_size == 1 or dim is None:
        return t.clone()
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


class StandInModel(nn.Module):
    def __init__(self, seed: int = 0, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        for n, t in full_tensors(seed).items():
            p = nn.Parameter(shard(n, t, tp_rank, tp_size))
            set_role(p, SPECS[n][1])
            self.register_parameter(n, p)

    def set_grads(self, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        for n, t in full_tensors(seed).items():
            p = getattr(self, n)
            p.grad = shard(n, t, tp_rank, tp_size).to(device=p.device, dtype=p.dtype)


class StandInGatedMLA(nn.Module):
    """Same attributes as k3train.model.mla.GatedMLA that QK-clip reads."""

    def __init__(self, num_heads=3, nope=4, rope=2, v=5, q_lora=6, kv_lora=7, d=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = num_heads, nope, rope, v
        self.q_b_proj = nn.Linear(q_lora, num_heads * (nope + rope), bias=False)
        self.kv_b_proj = nn.Linear(kv_lora, num_heads * (nope + v), bias=False)
        self.kv_a_proj = nn.Linear(d, kv_lora + rope, bias=False)
        for lin in (self.q_b_proj, self.kv_b_proj, self.kv_a_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g)
        self.register_buffer("max_logit", torch.full((num_heads,), float("-inf")))
        self.track_max_logit = True

    def logits(self, cq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Pre-softmax logits [H, Tq, Tk] from q-latents cq [Tq, q_lora] and inputs x [Tk, d]."""
        H, dn, dr, dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = (cq @ self.q_b_proj.weight.T).view(-1, H, dn + dr).transpose(0, 1)  # [H, Tq, dn+dr]
        kv_a = x @ self.kv_a_proj.weight.T
        c, k_r = kv_a[:, : -dr], kv_a[:, -dr:]
        kv = (c @ self.kv_b_proj.weight.T).view(-1, H, dn + dv).transpose(0, 1)
        k = torch.cat([kv[..., :dn], k_r.unsqueeze(0).expand(H, -1, -1)], dim=-1)
        return q @ k.transpose(1, 2) / (dn + dr) ** 0.5

    def track(self, cq, x):
        with torch.no_grad():
            lg = self.logits(cq, x)
            self.max_logit = torch.maximum(self.max_logit, lg.amax(dim=(1, 2)))
