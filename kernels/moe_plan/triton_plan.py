"""Triton routing plan: four launches for what the reference does in about twenty (a radix sort, its
inverse, a binary search for the counts, the padding shift, a bool scatter and a compaction).

The copies are cut into NB blocks of BLOCK; a block's copies of one group keep their order (a stable
counting sort, no atomics, so the plan is the reference's exactly)::

    1. _block_counts_kernel   one program per block b:  n[g, b] = #{copies of group g in block b}
    2. _scan_blocks_kernel    one program per group g:  before[g, b] = Σ_{b'<b} n[g, b'],  counts[g] = Σ_b n[g, b],
                                                        group_rows[g] = T·⌈counts[g] / T⌉
    3. _group_starts_kernel   one program: the groups' first packed row Σ_{g'<g} counts[g'], first padded row
                              Σ_{g'<g} group_rows[g'] and first entry in the padding list; offsets[g] =
                              Σ_{g'≤g} group_rows[g'] (int32, the grouped GEMMs' view)
    4. _place_kernel          one program per block: a copy c of group g in block b, with r earlier copies of g in
                              the block, goes to packed row  first packed[g] + before[g, b] + r  (order) and to
                              padded row  first padded[g] + before[g, b] + r  (inverse);
                              then (T > 1) one program per group writes its padding rows into pad_rows and its
                              row tiles' group into tile_group, and ⌈(R − M) / TP⌉ more write the rows past the
                              last group's (their tiles' group: −1).

The grouped GEMMs' view of the layout (offsets, tile_group) comes out of kernels 3 and 4, so that the expert-tiled
path needs no launch of its own for it (``group_offsets``' kernel, 3.6 µs a fwd+bwd at bench-1B on an H200, is then
left to layouts that no plan made: expert parallelism's).

Kernel 1 holds a [BLOCK, GP] one-hot tile of its copies against the groups (GP = G rounded up to a power of two),
so G is bounded (``MAX_GROUPS`` in ``__init__``); kernel 4 finds r from a [BLOCK, BLOCK] comparison of its copies
and reads its copies' starts by index, so BLOCK is also bounded (``GPU_BLOCK_MAX``). On bench-1B's 131,072 copies
(G = 128) on an H200: kernel 1 0.008 ms, 2 0.0017, 3 0.0012, 4 0.017. (A first version of kernel 4 took r from a
cumulative sum of the one-hot tile down the block and the starts as one-hot sums: 0.18 ms.) On CPU the kernels
run through Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported) on small blocks, so that
tests cover several blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# GPU_BLOCK_MAX bounds kernel 4's [BLOCK, BLOCK] compare (at 2048 it ran wrong or compiled for minutes). Swept on
# one H200 (bench-1B's 131,072 copies, G = 128, row tile 64; the four launches as CUDA-graph replays;
# docs/results/moe_permute_plan_sweep_s36_h200_2026-12-03.json): BLOCK 64 22.1-22.4 us with 4 or 8 warps, 128 22.6-26.3,
# 32 24.0-26.4.
GPU_TILE_ELEMS = 16384  # elements of a program's [BLOCK, GP] one-hot tile
GPU_BLOCK_MAX = 64
GPU_NUM_WARPS = 8
SCAN_CHUNK = 1024  # blocks a group's scan takes at a time
INTERPRET_BLOCK = 16


@triton.jit
def _block_counts_kernel(KEYS, N_BLOCK, M, NB, G, BLOCK: tl.constexpr, GP: tl.constexpr):
    b = tl.program_id(0)
    c = b * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(KEYS + c, mask=c < M, other=-1).to(tl.int32)
    g = tl.arange(0, GP)
    n = tl.sum((key[:, None] == g[None, :]).to(tl.int32), axis=0)
    tl.store(N_BLOCK + g.to(tl.int64) * NB + b, n, mask=g < G)


@triton.jit
def _scan_blocks_kernel(N_BLOCK, BEFORE, COUNTS, GROUP_ROWS, NB, T: tl.constexpr, CHUNK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    total = tl.sum(tl.zeros((CHUNK,), dtype=tl.int32), axis=0)
    for b0 in range(0, NB, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        n = tl.load(N_BLOCK + g * NB + b, mask=b < NB, other=0)
        tl.store(BEFORE + g * NB + b, total + tl.cumsum(n, axis=0) - n, mask=b < NB)
        total += tl.sum(n, axis=0)
    total = total.to(tl.int64)
    tl.store(COUNTS + g, total)
    tl.store(GROUP_ROWS + g, (total + T - 1) // T * T)


@triton.jit
def _group_starts_kernel(COUNTS, GROUP_ROWS, STARTS, OFFSETS, G, GP: tl.constexpr):
    """starts [3, G]: each group's first packed row, first padded row and first entry in the padding list;
    offsets [G] int32: each group's end row."""
    g = tl.arange(0, GP)
    counts = tl.load(COUNTS + g, mask=g < G, other=0)
    group_rows = tl.load(GROUP_ROWS + g, mask=g < G, other=0)
    pad = group_rows - counts
    ends = tl.cumsum(group_rows, axis=0)
    tl.store(STARTS + g, tl.cumsum(counts, axis=0) - counts, mask=g < G)
    tl.store(STARTS + G + g, ends - group_rows, mask=g < G)
    tl.store(STARTS + 2 * G + g, tl.cumsum(pad, axis=0) - pad, mask=g < G)
    tl.store(OFFSETS + g, ends.to(tl.int32), mask=g < G)


@triton.jit
def _place_kernel(KEYS, BEFORE, COUNTS, GROUP_ROWS, STARTS, ORDER, INVERSE, PAD_ROWS, TILE_GROUP, M, NB, G, ROWS,
                  BLOCK: tl.constexpr, T: tl.constexpr, TP: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NB:
        slot = tl.arange(0, BLOCK)
        c = pid * BLOCK + slot
        key = tl.load(KEYS + c, mask=c < M, other=-1).to(tl.int32)
        earlier = (key[:, None] == key[None, :]) & (slot[None, :] < slot[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier copies of the same group in the block
        g = tl.where(c < M, key, 0).to(tl.int64)
        before = tl.load(BEFORE + g * NB + pid, mask=c < M, other=0).to(tl.int64) + rank
        tl.store(ORDER + tl.load(STARTS + g, mask=c < M, other=0) + before, c.to(tl.int64), mask=c < M)
        tl.store(INVERSE + c, tl.load(STARTS + G + g, mask=c < M, other=0) + before, mask=c < M)
    else:
        p = tl.arange(0, TP)
        q = pid - NB
        if q < G:  # group q's padding rows (the last group_rows[q] − counts[q] of its rows), and its row tiles
            count, group_rows, start = tl.load(COUNTS + q), tl.load(GROUP_ROWS + q), tl.load(STARTS + G + q)
            tl.store(PAD_ROWS + tl.load(STARTS + 2 * G + q) + p, start + count + p, mask=p < group_rows - count)
            for t in range(0, group_rows // T, TP):
                tl.store(TILE_GROUP + start // T + t + p, q.to(tl.int32), mask=t + p < group_rows // T)
        else:  # the rows past the last group's, [Σ group_rows, ROWS), listed after the groups' padding rows
            last, j = G - 1, (q - G) * TP + p
            rows_used = tl.load(STARTS + G + last) + tl.load(GROUP_ROWS + last)
            listed = tl.load(STARTS + 2 * G + last) + tl.load(GROUP_ROWS + last) - tl.load(COUNTS + last)
            tl.store(PAD_ROWS + listed + j, rows_used + j, mask=rows_used + j < ROWS)
            tl.store(TILE_GROUP + (rows_used + j) // T, -1, mask=(rows_used + j < ROWS) & (j % T == 0))


@triton.jit
def _group_offsets_kernel(GROUP_ROWS, OFFSETS, TILE_GROUP, G, TILES, T: tl.constexpr, GP: tl.constexpr,
                          TB: tl.constexpr):
    """offsets = cumsum(group_rows) (program 0); tile_group[t] = #{g : offsets[g] / T ≤ t} (−1 past the last)."""
    g = tl.arange(0, GP)
    ends = tl.cumsum(tl.load(GROUP_ROWS + g, mask=g < G, other=0), axis=0)
    if tl.program_id(0) == 0:
        tl.store(OFFSETS + g, ends.to(tl.int32), mask=g < G)
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    group = tl.sum(((ends[None, :] // T <= t[:, None]) & (g < G)[None, :]).to(tl.int32), axis=1)
    tl.store(TILE_GROUP + t, tl.where(group < G, group, -1), mask=t < TILES)


def interpreter_active() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_place_kernel, InterpretedFunction)


def routing_plan(keys: torch.Tensor, groups: int, row_tile: int, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """keys [M] int32/int64 contiguous, values in [0, groups) → (order [M], inverse [M], counts [G],
    group_rows [G], pad_rows [rows − M]) int64 (``reference.routing_plan``) and (offsets [G], tile_group
    [rows / row_tile, none for row_tile 1]) int32 (``reference.group_offsets``)."""
    m, dev = keys.numel(), keys.device
    gp = triton.next_power_of_2(max(groups, 1))
    if keys.is_cuda:
        block, opts = min(GPU_BLOCK_MAX, max(16, GPU_TILE_ELEMS // gp)), {"num_warps": GPU_NUM_WARPS}
    elif interpreter_active():
        block, opts = INTERPRET_BLOCK, {}
    else:
        raise RuntimeError("the Triton routing-plan kernels got a CPU tensor, but Triton's interpreter is off: "
                           "set TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")
    nb = triton.cdiv(m, block)
    order, inverse = (torch.empty(m, dtype=torch.int64, device=dev) for _ in range(2))
    counts, group_rows = (torch.empty(groups, dtype=torch.int64, device=dev) for _ in range(2))
    pad_rows = torch.empty(rows - m, dtype=torch.int64, device=dev)
    tiles = rows // row_tile if row_tile > 1 else 0
    offsets, tile_group = (torch.empty(n, dtype=torch.int32, device=dev) for n in (groups, tiles))
    if m == 0:
        for t in (counts, group_rows, offsets):
            t.zero_()
        return order, inverse, counts, group_rows, torch.arange(rows, device=dev), offsets, tile_group.fill_(-1)
    n_block = torch.empty(groups, nb, dtype=torch.int32, device=dev)
    before = torch.empty_like(n_block)
    starts = torch.empty(3, groups, dtype=torch.int64, device=dev)
    _block_counts_kernel[(nb,)](keys, n_block, m, nb, groups, BLOCK=block, GP=gp, **opts)
    _scan_blocks_kernel[(groups,)](n_block, before, counts, group_rows, nb, T=row_tile,
                                   CHUNK=min(SCAN_CHUNK, triton.next_power_of_2(nb)))
    _group_starts_kernel[(1,)](counts, group_rows, starts, offsets, groups, GP=gp)
    tp = triton.next_power_of_2(row_tile)
    pad_programs = groups + triton.cdiv(rows - m, tp) if row_tile > 1 else 0
    _place_kernel[(nb + pad_programs,)](keys, before, counts, group_rows, starts, order, inverse, pad_rows, tile_group,
                                        m, nb, groups, rows, BLOCK=block, T=row_tile, TP=tp, **opts)
    return order, inverse, counts, group_rows, pad_rows, offsets, tile_group


def group_offsets(group_rows: torch.Tensor, row_tile: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_rows [G] int64 contiguous → (offsets [G] int32, tile_group [tiles] int32): one launch."""
    groups, dev = group_rows.numel(), group_rows.device
    gp = triton.next_power_of_2(max(groups, 1))
    tb = max(16, (GPU_TILE_ELEMS if group_rows.is_cuda else 256) // gp)
    opts = {"num_warps": GPU_NUM_WARPS} if group_rows.is_cuda else {}
    offsets = torch.empty(groups, dtype=torch.int32, device=dev)
    tile_group = torch.empty(tiles, dtype=torch.int32, device=dev)
    if groups:
        _group_offsets_kernel[(max(1, triton.cdiv(tiles, tb)),)](group_rows, offsets, tile_group, groups, tiles,
                                                                  T=row_tile, GP=gp, TB=tb, **opts)
    return offsets, tile_group
