"""Split parameters between Muon and AdamW by their declared role, and plan Muon's blocks.

Nothing here matches parameter names: every decision reads ``param.k3_role``
(``k3train.model.roles``). Names are only carried for error messages and logs.

Muon treatment of one parameter (a ``MuonSpec``):

- ``per_head``: a ``Kind.MATRIX`` whose ``head_group`` is listed in ``cfg.per_head_groups``.
  Its momentum [rows, cols] is cut into rows/head_dim blocks of [head_dim, cols].
- ``whole``: any other ``Kind.MATRIX``: one block, the full (TP-gathered) matrix.
- ``expert``: ``Kind.EXPERT_MATRIX`` [E, out, in]: one block per expert.

Tensor parallelism (``role.tp_partition_dim``): a per-head matrix sharded on dim 0
(column-parallel) keeps whole heads on every rank, so its blocks are local and need no
communication. Everything else that is sharded (a whole matrix, a per-head matrix
sharded on its columns, an expert stack sharded inside a matrix) is all-gathered over
the TP group before orthogonalization, and each rank keeps its slice of the update.
An expert stack sharded on dim 0 (experts split over ranks) is local.

A role with ``tp_partition_stride`` s > 1 (the fused expert gate|up stack ``w13``) holds s
logical matrices along its partition dim; each is orthogonalized separately (as the HF
checkpoint's separate w1 and w3), and the TP gather/slice respects the stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from k3train.model.roles import Kind, ParamRole, require_role

MUON_KINDS = (Kind.MATRIX, Kind.EXPERT_MATRIX)


@dataclass
class MuonSpec:
    """How Muon orthogonalizes one parameter (shapes are for this rank's tensor)."""

    name: str
    mode: str  # "per_head" | "whole" | "expert"
    local_shape: tuple[int, ...]
    gather_dim: Optional[int]  # dim to all-gather over TP before NS (None: local)
    full_shape: tuple[int, ...]  # shape after the TP gather (== local_shape when local)
    num_blocks: int
    block_shape: tuple[int, int]  # [m, n] of one block in the parameter's orientation
    head_dim: Optional[int] = None
    stride: int = 1  # logical matrices side by side along ``stride_dim`` (e.g. gate | up)
    stride_dim: Optional[int] = None

    @property
    def transposed(self) -> bool:
        """Blocks are orthogonalized in 'wide' orientation (m <= n)."""
        return self.block_shape[0] > self.block_shape[1]

    @property
    def canonical_shape(self) -> tuple[int, int]:
        m, n = self.block_shape
        return (n, m) if m > n else (m, n)

    def blocks(self, full: torch.Tensor) -> torch.Tensor:
        """View a full-shape tensor as [num_blocks, m, n] (parameter orientation; always a view)."""
        m, n = self.block_shape
        s = self.stride
        if self.mode == "per_head":
            return full.view(self.num_blocks, m, n)
        if self.mode == "whole":
            if s == 1:
                return full.unsqueeze(0)
            if self.stride_dim == 0:
                return full.view(s, m, n)
            return full.view(m, s, n).transpose(0, 1)
        if s == 1:
            return full
        return full.view(full.shape[0] * s, m, n)  # stride on dim 1 of [E, out, in]


def tp_gather_cat(pieces: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Full tensor from the TP ranks' shards along ``dim`` (each of ``stride`` parts sharded separately)."""
    if stride == 1:
        return torch.cat(pieces, dim=dim)
    parts = [p.chunk(stride, dim=dim) for p in pieces]
    return torch.cat([parts[r][k] for k in range(stride) for r in range(len(pieces))], dim=dim)


def tp_local_slice(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor (inverse of ``tp_gather_cat``)."""
    if stride == 1:
        return full.chunk(size, dim=dim)[rank]
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in full.chunk(stride, dim=dim)], dim=dim)


def muon_spec(name: str, param: torch.Tensor, role: ParamRole, per_head_groups, tp_size: int = 1) -> MuonSpec:
    """Plan the Muon blocks of one parameter. Raises ValueError on inconsistent roles.

    A role with ``tp_partition_stride`` s > 1 declares s logical matrices side by side along
    its partition dim (e.g. an expert's gate rows then up rows); each is orthogonalized on
    its own, at any TP size.
    """
    shape = tuple(param.shape)
    stride = int(getattr(role, "tp_partition_stride", 1) or 1)
    sdim = role.tp_partition_dim if stride > 1 else None
    tp_dim = role.tp_partition_dim if tp_size > 1 else None
    if stride > 1 and (sdim is None or shape[sdim] % stride):
        raise ValueError(f"parameter '{name}': tp_partition_stride={stride} needs a partition dim divisible by it")
    if role.kind == Kind.MATRIX:
        if param.ndim != 2:
            raise ValueError(f"parameter '{name}' has role MATRIX but shape {shape}; a MATRIX must be 2-D")
        if role.tp_partition_dim not in (None, 0, 1):
            raise ValueError(f"parameter '{name}': tp_partition_dim={role.tp_partition_dim} is not a dim of a 2-D matrix")
        per_head = role.head_group is not None and role.head_group in per_head_groups
        if per_head:
            hd = role.head_dim
            if stride > 1:
                raise ValueError(f"parameter '{name}': per-head matrices cannot declare tp_partition_stride")
            if hd is None or hd <= 0:
                raise ValueError(
                    f"parameter '{name}' is in per-head group '{role.head_group}' but declares head_dim={hd}"
                )
            if shape[0] % hd != 0:
                raise ValueError(
                    f"parameter '{name}' is declared per-head (group '{role.head_group}', head_dim {hd}) "
                    f"but its {shape[0]} local rows are not divisible by the head size"
                )
            gather_dim = 1 if tp_dim == 1 else None  # column-parallel: heads are local
            full = list(shape)
            if gather_dim is not None:
                full[gather_dim] *= tp_size
            return MuonSpec(name, "per_head", shape, gather_dim, tuple(full), full[0] // hd, (hd, full[1]), hd)
        full = list(shape)
        if tp_dim is not None:
            full[tp_dim] *= tp_size
        block = list(full)
        if stride > 1:
            block[sdim] //= stride
        return MuonSpec(name, "whole", shape, tp_dim, tuple(full), stride, (block[0], block[1]),
                        stride=stride, stride_dim=sdim)
    if role.kind == Kind.EXPERT_MATRIX:
        if param.ndim != 3:
            raise ValueError(
                f"parameter '{name}' has role EXPERT_MATRIX but shape {shape}; expected [E, out, in]"
            )
        if role.tp_partition_dim not in (None, 0, 1, 2):
            raise ValueError(f"parameter '{name}': tp_partition_dim={role.tp_partition_dim} is not a dim of [E, out, in]")
        if stride > 1 and sdim != 1:
            raise ValueError(f"parameter '{name}': an expert stack supports tp_partition_stride only on dim 1")
        gather_dim = tp_dim if tp_dim in (1, 2) else None  # experts split over ranks: local
        full = list(shape)
        if gather_dim is not None:
            full[gather_dim] *= tp_size
        return MuonSpec(name, "expert", shape, gather_dim, tuple(full), full[0] * stride,
                        (full[1] // stride, full[2]), stride=stride, stride_dim=sdim)
    raise ValueError(f"parameter '{name}' of kind {role.kind} is not a Muon parameter")


@dataclass
class SplitParams:
    muon: list[tuple[str, torch.nn.Parameter]]
    adamw_decay: list[tuple[str, torch.nn.Parameter]]
    adamw_no_decay: list[tuple[str, torch.nn.Parameter]]


def split_params(named_params) -> SplitParams:
    """Partition (name, param) pairs by role. Frozen parameters are left out.

    Raises ValueError for a parameter with no role (``require_role``) and for a
    parameter listed twice.
    """
    out = SplitParams([], [], [])
    seen: set[int] = set()
    for name, p in named_params:
        role = require_role(name, p)
        if not p.requires_grad:
            continue
        if id(p) in seen:
            raise ValueError(f"parameter '{name}' is listed twice")
        seen.add(id(p))
        if role.kind in MUON_KINDS:
            out.muon.append((name, p))
        elif role.no_weight_decay:
            out.adamw_no_decay.append((name, p))
        else:
            out.adamw_decay.append((name, p))
    return out


def cfg_get(cfg: Any, key: str, default=None):
    """Read an OptimConfig field from a dataclass, a DictConfig or a plain dict."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)
