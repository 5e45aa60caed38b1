"""Parameter roles: what each parameter *is*, declared by the module that owns it.

The optimizer, the weight-decay split, tensor-parallel gradient handling and the
checkpoint converter all read these roles instead of matching parameter names.

A role is attached to the ``nn.Parameter`` object itself (attribute ``k3_role``),
so it survives ``named_parameters()``, FSDP-free wrapping and ``model.to(...)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Kind(str, enum.Enum):
    """How an optimizer should treat a parameter."""

    MATRIX = "matrix"  # hidden 2-D weight: Muon (whole, or per head when head_group is set)
    EXPERT_MATRIX = "expert_matrix"  # stacked routed-expert weights [E, out, in]: Muon per expert
    EMBEDDING = "embedding"  # token embedding table: AdamW
    LM_HEAD = "lm_head"  # output projection to the vocabulary: AdamW
    NORM = "norm"  # RMSNorm gains: AdamW, no weight decay
    PSEUDO_QUERY = "pseudo_query"  # AttnRes pseudo-query w: AdamW, no weight decay
    GATE_PARAM = "gate_param"  # KDA A_log and dt_bias: AdamW, no weight decay, fp32
    CONV = "conv"  # KDA short-conv weights: AdamW
    VECTOR = "vector"  # any other 1-D parameter: AdamW, no weight decay


@dataclass(frozen=True)
class ParamRole:
    """Role of one parameter.

    ``head_group`` names the per-head family a matrix belongs to (``"kda_qkv"``,
    ``"mla_q_b"``, ``"mla_kv_b"``); whether that family is orthogonalized per head is
    optimizer config. ``head_dim`` is the number of output rows of one head's block.
    ``tp_partition_dim`` is the dimension sharded over tensor parallelism (None when the
    parameter is replicated); per-head blocks never straddle a TP shard.
    """

    kind: Kind
    head_group: str | None = None
    head_dim: int | None = None
    tp_partition_dim: int | None = None
    # s > 1: the rows (dim -2: dim 0 of a MATRIX, the output dim of each expert of an EXPERT_MATRIX)
    # interleave s logical matrices, row r belonging to matrix r mod s (the experts' fused w13: s = 2,
    # rows gate_0, up_0, gate_1, up_1, ...). Muon orthogonalizes each matrix on its own; a TP shard
    # along the rows is a contiguous run of whole groups of s rows, so plain sharding keeps the layout.
    row_interleave: int = 1
    # The dimension sharded over expert parallelism (the expert dim of a routed-expert stack):
    # gradients are reduced over the expert-data-parallel ranks and norms summed over EP.
    ep_partition_dim: int | None = None
    # Held in fp32 by the model also when its parameters are bf16 (precision.params=bf16;
    # k3train/precision/main_params.py): K3_SPEC §2.2 and §4 mark KDA's A_log, dt_bias,
    # short-conv weights and o_norm fp32; the router weight (§2.4, fp32 router) and AttnRes's
    # pseudo-query and key gain (fp32 aggregation) are kept fp32 to save their casts.
    keep_fp32: bool = False

    @property
    def no_weight_decay(self) -> bool:
        return self.kind in (Kind.NORM, Kind.PSEUDO_QUERY, Kind.GATE_PARAM, Kind.VECTOR)


ROLE_ATTR = "k3_role"


def interleave_rows(parts: torch.Tensor) -> torch.Tensor:
    """parts [..., s, n, cols] (s matrices of n rows) → [..., s·n, cols] with row s·j + k = row j of
    matrix k: the layout of a role with ``row_interleave`` = s."""
    return parts.transpose(-3, -2).flatten(-3, -2)


def deinterleave_rows(t: torch.Tensor, s: int) -> torch.Tensor:
    """Inverse of ``interleave_rows``: t [..., s·n, cols] → [..., s, n, cols], matrix k = rows k::s (a view)."""
    return t.unflatten(-2, (-1, s)).transpose(-3, -2)


def set_role(param: torch.nn.Parameter, role: ParamRole) -> torch.nn.Parameter:
    setattr(param, ROLE_ATTR, role)
    return param


def get_role(param: torch.Tensor) -> ParamRole | None:
    return getattr(param, ROLE_ATTR, None)


def require_role(name: str, param: torch.Tensor) -> ParamRole:
    role = get_role(param)
    if role is None:
        raise ValueError(
            f"parameter '{name}' has no declared role; the module that creates it must call "
            f"k3train.model.roles.set_role(param, ParamRole(...))"
        )
    return role
