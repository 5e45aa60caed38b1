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

A role with ``row_interleave`` s > 1 (the fused expert stack ``w13``, rows gate_0, up_0, gate_1, ...)
holds s logical matrices interleaved along its rows: after any TP gather (a TP shard is a contiguous
run of whole row groups, so the gather is a plain concatenation) rows k::s form matrix k, and each is
orthogonalized separately (as the HF checkpoint's separate w1 and w3).
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
    row_interleave: int = 1  # s logical matrices interleaved along the rows (dim -2): matrix k = rows k::s

    @property
    def transposed(self) -> bool:
        """Blocks are orthogonalized in 'wide' orientation (m <= n)."""
        return self.block_shape[0] > self.block_shape[1]

    @property
    def canonical_shape(self) -> tuple[int, int]:
        m, n = self.block_shape
        return (n, m) if m > n else (m, n)

    def blocks(self, full: torch.Tensor) -> list[torch.Tensor]:
        """A full-shape tensor as views [num_blocks / s, m, n] (parameter orientation), one per interleaved
        matrix k (rows k::s; s = ``row_interleave``): together the num_blocks blocks, matrix-major, the order
        of ``split``."""
        m, n = self.block_shape
        if self.mode == "per_head":
            return [full.view(self.num_blocks, m, n)]
        s = self.row_interleave
        parts = [full] if s == 1 else [full[..., k::s, :] for k in range(s)]
        return [p.unsqueeze(0) for p in parts] if self.mode == "whole" else parts

    def split(self, stack: torch.Tensor) -> list[torch.Tensor]:
        """[num_blocks, ...] (the blocks of ``blocks``, matrix-major) → one [num_blocks / s, ...] view a matrix."""
        return list(stack.chunk(self.row_interleave)) if self.row_interleave > 1 else [stack]


def muon_spec(name: str, param: torch.Tensor, role: ParamRole, per_head_groups, tp_size: int = 1) -> MuonSpec:
    """Plan the Muon blocks of one parameter. Raises ValueError on inconsistent roles.

    A role with ``row_interleave`` s > 1 declares s logical matrices interleaved along its rows (dim -2; e.g.
    an expert's gate and up rows in pairs): each is orthogonalized on its own, at any TP size.
    """
    shape = tuple(param.shape)
    s = role.row_interleave
    tp_dim = role.tp_partition_dim if tp_size > 1 else None
    if s < 1 or (param.ndim >= 2 and shape[-2] % s):
        raise ValueError(f"parameter '{name}': row_interleave={s} must be >= 1 and divide its {shape[-2]} "
                         f"local rows (a TP shard holds whole groups of {s} rows)")
    if role.kind == Kind.MATRIX:
        if param.ndim != 2:
            raise ValueError(f"parameter '{name}' has role MATRIX but shape {shape}; a MATRIX must be 2-D")
        if role.tp_partition_dim not in (None, 0, 1):
            raise ValueError(f"parameter '{name}': tp_partition_dim={role.tp_partition_dim} is not a dim of a 2-D matrix")
        per_head = role.head_group is not None and role.head_group in per_head_groups
        if per_head:
            hd = role.head_dim
            if s > 1:
                raise ValueError(f"parameter '{name}': per-head matrices cannot declare row_interleave={s}; "
                                 f"drop it or take the matrix out of optim.per_head_groups")
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
        return MuonSpec(name, "whole", shape, tp_dim, tuple(full), s, (full[0] // s, full[1]), row_interleave=s)
    if role.kind == Kind.EXPERT_MATRIX:
        if param.ndim != 3:
            raise ValueError(
                f"parameter '{name}' has role EXPERT_MATRIX but shape {shape}; expected [E, out, in]"
            )
        if role.tp_partition_dim not in (None, 0, 1, 2):
            raise ValueError(f"parameter '{name}': tp_partition_dim={role.tp_partition_dim} is not a dim of [E, out, in]")
        gather_dim = tp_dim if tp_dim in (1, 2) else None  # experts split over ranks: local
        full = list(shape)
        if gather_dim is not None:
            full[gather_dim] *= tp_size
        return MuonSpec(name, "expert", shape, gather_dim, tuple(full), full[0] * s, (full[1] // s, full[2]),
                        row_interleave=s)
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
