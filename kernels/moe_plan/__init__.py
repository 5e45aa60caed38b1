"""The MoE layer's routing plan: from each token copy's expert, the grouped-row layout that the permutation
(``kernels.moe_permute``) and the grouped GEMMs use (math in ``reference.py``)::

    plan = routing_plan(experts, groups, row_tile=1)
    # experts [N, k] (values in [0, groups)) → RoutingPlan of tensors on experts' device:
    #   order [N·k], inverse [N·k], counts [G], group_rows [G], pad_rows [R − N·k] (None for row_tile 1), int64;
    #   offsets [G], tile_group [R / row_tile] (None for row_tile 1), int32: the layout as group_offsets gives it

and the grouped GEMMs' view of a layout of G groups (the plan gives its own; this for the expert-parallel
dispatcher's)::

    offsets, tile_group = group_offsets(group_rows, row_tile, tiles)
    # group_rows [G] → offsets [G] int32 (cumulative rows), tile_group [tiles] int32 (each row tile's group)

The padded layout has R = ``grouped_gemm_sm90.capacity_tiles(N·k, G, row_tile)`` · row_tile rows, enough for any
routing (``layout_rows``). No host reads. ``backend``:

* ``"auto"``: ``"triton"`` for CUDA tensors (and CPU ones within ``backend.triton_on_cpu``) with G ≤ ``MAX_GROUPS``,
  ``"torch"`` otherwise;
* ``"triton"``: the four launches of ``triton_plan.py`` (offsets and tile_group included; ``group_offsets``: one
  more) for the ~25 small kernels of the
  reference, which summed to ~0.09 ms of bench-1B's MoE fwd+bwd on an H200 (docs/moe_notes.md §2, session 30).
  Under ``torch.compile`` through the custom ops ``k3::moe_routing_plan`` / ``k3::moe_group_offsets``
  (``backend.eager_or_compiled``);
* ``"torch"``: ``reference.routing_plan``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backend import BACKENDS, eager_or_compiled, triton_device
from ..grouped_gemm_sm90 import capacity_tiles
from . import reference
from .reference import inverse_permutation, stable_sort

__all__ = ["RoutingPlan", "routing_plan", "group_offsets", "layout_rows", "stable_sort", "inverse_permutation"]

MAX_GROUPS = 1024  # the Triton kernels hold a [block, G] one-hot tile a program


class RoutingPlan(NamedTuple):
    """Where each token copy c = i·k + j goes: packed row m holds copy ``order[m]`` (the stable sort by
    expert), copy c sits at grouped row ``inverse[c]`` of the (padded) layout; ``counts`` [G] copies per
    group, ``group_rows`` [G] rows per group (counts padded to a multiple of row_tile), ``pad_rows`` the rows
    that hold no copy (None without padding); ``offsets`` and ``tile_group`` (None without padding) the layout
    as ``group_offsets`` gives it."""

    order: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    group_rows: torch.Tensor
    pad_rows: torch.Tensor | None
    offsets: torch.Tensor
    tile_group: torch.Tensor | None


def _triton(keys: torch.Tensor, groups: int, row_tile: int, rows: int):
    from .triton_plan import routing_plan as kernels
    return kernels(keys, groups, row_tile, rows)


@torch.library.custom_op("k3::moe_routing_plan", mutates_args=())
def _plan_op(keys: torch.Tensor, groups: int, row_tile: int, rows: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor]:
    return _triton(keys, groups, row_tile, rows)


@_plan_op.register_fake
def _(keys, groups, row_tile, rows):
    m = keys.numel()
    long, int32 = dict(dtype=torch.int64, device=keys.device), dict(dtype=torch.int32, device=keys.device)
    return (torch.empty(m, **long), torch.empty(m, **long), torch.empty(groups, **long),
            torch.empty(groups, **long), torch.empty(rows - m, **long), torch.empty(groups, **int32),
            torch.empty(rows // row_tile if row_tile > 1 else 0, **int32))


_plan = eager_or_compiled(_triton, _plan_op)


def _triton_offsets(group_rows: torch.Tensor, row_tile: int, tiles: int):
    from .triton_plan import group_offsets as kernel
    return kernel(group_rows, row_tile, tiles)


@torch.library.custom_op("k3::moe_group_offsets", mutates_args=())
def _offsets_op(group_rows: torch.Tensor, row_tile: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_offsets(group_rows, row_tile, tiles)


@_offsets_op.register_fake
def _(group_rows, row_tile, tiles):
    return (torch.empty(group_rows.numel(), dtype=torch.int32, device=group_rows.device),
            torch.empty(tiles, dtype=torch.int32, device=group_rows.device))


_offsets = eager_or_compiled(_triton_offsets, _offsets_op)


def layout_rows(copies: int, groups: int, row_tile: int) -> int:
    """Rows of the grouped layout: the copies, or with row_tile > 1 enough tiles for any split among the groups."""
    return copies if row_tile == 1 else capacity_tiles(copies, groups, row_tile) * row_tile


def routing_plan(experts: torch.Tensor, groups: int, row_tile: int = 1, backend: str = "auto") -> RoutingPlan:
    """experts [N, k] int → ``RoutingPlan`` (module docstring)."""
    if experts.dim() != 2 or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts must be an int32/int64 [N, k] tensor, got {experts.dtype} {tuple(experts.shape)}")
    if row_tile < 1 or groups < 1:
        raise ValueError(f"row_tile and groups must be ≥ 1, got {row_tile} and {groups}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown routing-plan backend {backend!r}; expected one of {BACKENDS}")
    keys, rows = experts.flatten(), layout_rows(experts.numel(), groups, row_tile)
    if backend == "triton" and groups > MAX_GROUPS:
        raise ValueError(f"the Triton routing plan takes at most {MAX_GROUPS} groups, got {groups}: use backend='torch'")
    if backend == "triton" or (backend == "auto" and triton_device(keys) and groups <= MAX_GROUPS):
        plan = _plan(keys.contiguous(), groups, row_tile, rows)
    else:
        plan = reference.routing_plan(keys, groups, row_tile, rows)
        plan = (*plan, *reference.group_offsets(plan[3], row_tile, rows // row_tile if row_tile > 1 else 0))
    padded = row_tile > 1
    return RoutingPlan(*plan[:4], plan[4] if padded else None, plan[5], plan[6] if padded else None)


def group_offsets(group_rows: torch.Tensor, row_tile: int = 1, tiles: int = 0, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """group_rows [G] int (each a multiple of row_tile) → (offsets [G] int32, tile_group [tiles] int32)."""
    if group_rows.dim() != 1 or group_rows.dtype not in (torch.int32, torch.int64) or row_tile < 1:
        raise ValueError(f"group_rows must be an int32/int64 [G] tensor and row_tile ≥ 1, got {group_rows.dtype} "
                         f"{tuple(group_rows.shape)} and {row_tile}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown routing-plan backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton" and group_rows.numel() > MAX_GROUPS:
        raise ValueError(f"the Triton group offsets take at most {MAX_GROUPS} groups, got {group_rows.numel()}")
    if backend == "triton" or (backend == "auto" and triton_device(group_rows) and group_rows.numel() <= MAX_GROUPS):
        return _offsets(group_rows.long().contiguous(), row_tile, tiles)
    return reference.group_offsets(group_rows, row_tile, tiles)
