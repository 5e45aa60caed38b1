"""Plain-torch routing plan of the MoE layer: where each token copy goes in the expert-grouped rows.

With keys [M] (each token copy's group, M = N·k, copy c = i·k + j is token i's j-th choice), G groups and a
row tile T::

    counts[g]     = #{c : keys[c] = g}
    order         = the stable sort of the copies by group: packed row m holds copy order[m]
    group_rows[g] = T·⌈counts[g] / T⌉                       (each group padded to a multiple of T)
    inverse[c]    = start[g] + #{c' < c : keys[c'] = g},  g = keys[c],  start[g] = Σ_{g'<g} group_rows[g']
    pad_rows      = the rows in [0, R) that no copy maps to, ascending (R ≥ Σ_g group_rows[g]; T > 1 only)

With T = 1, group_rows = counts and inverse is the inverse permutation of order. The grouped GEMMs read the layout
as (``group_offsets``)::

    offsets[g]    = Σ_{g' ≤ g} group_rows[g']                (int32)
    tile_group[t] = the group of row tile t = #{g : offsets[g] / T ≤ t}, −1 past the last group's rows

Nothing reads the host.
"""

from __future__ import annotations

import torch

from ..grouped_gemm_sm90 import padding_shift, tile_groups


def stable_sort(keys: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted keys, stable sorting order [M] int64) of integer ``keys`` [M] with values in [0, bound), sorted
    in the narrowest integer type that holds them (the sorted keys come back in it): the GPU's radix sort
    makes one pass per key byte (8 for int64)."""
    dtype = torch.uint8 if bound <= 256 else torch.int16 if bound <= 2**15 else torch.int32
    return keys.to(dtype).sort(stable=True)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[m]] = m."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def routing_plan(keys: torch.Tensor, groups: int, row_tile: int, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [M] → (order [M], inverse [M], counts [G], group_rows [G], pad_rows [rows − M]), all int64."""
    sorted_keys, order = stable_sort(keys, groups)
    ends = torch.searchsorted(sorted_keys, torch.arange(groups, device=keys.device, dtype=sorted_keys.dtype),
                              right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    inverse = inverse_permutation(order)
    if row_tile == 1:  # the packed layout: nothing to pad (the dispatcher's default path, kept to these kernels)
        return order, inverse, counts, counts, order.new_empty(0)
    group_rows = (counts + row_tile - 1) // row_tile * row_tile
    inverse = inverse + padding_shift(counts, row_tile)[keys.long()]
    taken = torch.zeros(rows, dtype=torch.bool, device=keys.device).index_fill_(0, inverse, True)
    pad_rows = torch.nonzero_static(~taken, size=rows - keys.numel()).squeeze(1)
    return order, inverse, counts, group_rows, pad_rows


def group_offsets(group_rows: torch.Tensor, row_tile: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_rows [G] → (offsets [G] int32, tile_group [tiles] int32)."""
    offsets = group_rows.cumsum(0).to(torch.int32)
    return offsets, tile_groups(offsets // row_tile, tiles) if tiles else offsets.new_empty(0)
