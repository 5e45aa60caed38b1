"""MoE routing plan (kernels/moe_plan): the torch reference against its definition (stable argsort, bincount, the
padded layout), and the Triton kernels against the reference, exactly (CPU: Triton interpreter; GPU: the same
tests on CUDA)."""

from __future__ import annotations

import pytest
import torch
from triton_cpu import rerun_under_interpreter, triton_cpu

from kernels.moe_plan import group_offsets, layout_rows, routing_plan, stable_sort

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def experts_of(N: int, E: int, k: int, seed: int, skew: bool = False, device=DEV) -> torch.Tensor:
    """[N, k] distinct experts a token, uniform; ``skew``: drawn from the first quarter of the experts only (empty
    groups, uneven counts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g)
    if skew:
        scores[:, max(k, E // 4):] -= 2.0
    return scores.argsort(dim=1, descending=True)[:, :k].to(device)


@pytest.mark.parametrize("bound", [2, 128, 256, 257, 896, 2**15, 2**15 + 1])
def test_stable_sort_equals_int64_argsort(bound):
    g = torch.Generator().manual_seed(bound)
    keys = torch.randint(0, min(bound, 200), (5000,), generator=g)  # values above 200 never occur
    keys[:50] = bound - 1  # the largest key, and many ties
    sorted_keys, order = stable_sort(keys, bound)
    assert order.dtype == torch.int64
    assert torch.equal(order, keys.argsort(stable=True))
    assert torch.equal(sorted_keys.long(), keys[order])


@pytest.mark.parametrize("row_tile", [1, 8])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_reference_is_the_padded_stable_sort(row_tile, skew):
    N, E, k = 300, 24, 3
    experts = experts_of(N, E, k, seed=row_tile, skew=skew, device="cpu")
    keys = experts.flatten()
    plan = routing_plan(experts, E, row_tile, backend="torch")
    counts = torch.bincount(keys, minlength=E)
    assert torch.equal(plan.counts, counts) and (not skew or (counts == 0).any())
    assert torch.equal(plan.order, keys.argsort(stable=True))
    assert torch.equal(plan.group_rows, (counts + row_tile - 1) // row_tile * row_tile)
    start = plan.group_rows.cumsum(0) - plan.group_rows
    packed_start = counts.cumsum(0) - counts
    want = torch.empty_like(keys)
    want[plan.order] = torch.arange(keys.numel()) - packed_start[keys[plan.order]] + start[keys[plan.order]]
    assert torch.equal(plan.inverse, want)
    rows = layout_rows(keys.numel(), E, row_tile)
    if row_tile == 1:
        assert plan.pad_rows is None and plan.tile_group is None and rows == keys.numel()
    else:
        free = torch.ones(rows, dtype=torch.bool)
        free[plan.inverse] = False
        assert torch.equal(plan.pad_rows, free.nonzero().squeeze(1)) and plan.pad_rows.numel() > 0
    offsets, tile_group = group_offsets(plan.group_rows, row_tile, rows // row_tile if row_tile > 1 else 0)
    assert plan.offsets.dtype == torch.int32 and torch.equal(plan.offsets, offsets)
    assert row_tile == 1 or (plan.tile_group.dtype == torch.int32 and torch.equal(plan.tile_group, tile_group))


@pytest.mark.parametrize("row_tile", [1, 8])
def test_reference_group_offsets(row_tile):
    """offsets are the cumulative rows; each row tile's group is the group of its first row (−1 past the last)."""
    plan = routing_plan(experts_of(300, 24, 3, seed=7, skew=True, device="cpu"), 24, row_tile, backend="torch")
    tiles = layout_rows(900, 24, row_tile) // row_tile
    offsets, tile_group = group_offsets(plan.group_rows, row_tile, tiles, backend="torch")
    assert offsets.dtype == tile_group.dtype == torch.int32
    assert torch.equal(offsets.long(), plan.group_rows.cumsum(0))
    group_of_row = torch.repeat_interleave(torch.arange(24), plan.group_rows)
    first_rows = torch.arange(tiles) * row_tile
    want = torch.where(first_rows < offsets[-1], group_of_row[first_rows.clamp(max=len(group_of_row) - 1)], -1)
    assert torch.equal(tile_group.long(), want) and (want == -1).any() == (row_tile > 1)


def test_errors():
    experts = experts_of(4, 8, 2, seed=0, device="cpu")
    with pytest.raises(ValueError, match="int32/int64 \\[N, k\\]"):
        routing_plan(experts.float(), 8)
    with pytest.raises(ValueError, match="row_tile and groups"):
        routing_plan(experts, 8, row_tile=0)
    with pytest.raises(ValueError, match="unknown routing-plan backend"):
        routing_plan(experts, 8, backend="cuda")
    with pytest.raises(ValueError, match="at most 1024 groups"):
        routing_plan(experts, 2000, backend="triton")
    with pytest.raises(ValueError, match="int32/int64 \\[G\\]"):
        group_offsets(torch.ones(2, 2, dtype=torch.long))


@triton_cpu
@pytest.mark.parametrize("N,E,k,row_tile", [(37, 8, 3, 1), (37, 8, 3, 4), (50, 6, 2, 8), (1, 5, 1, 4),
                                            (100, 96, 4, 16), (64, 8, 2, 8), (0, 8, 2, 4)])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_triton_matches_reference(N, E, k, row_tile, skew):
    experts = experts_of(N, E, k, seed=N + E + row_tile, skew=skew)
    want = routing_plan(experts, E, row_tile, backend="torch")
    for keys in (experts, experts.int()):
        got = routing_plan(keys, E, row_tile, backend="triton")
        for name, a, b in zip(want._fields, got, want):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name


@triton_cpu
@pytest.mark.parametrize("G,row_tile,tiles", [(8, 4, 40), (5, 1, 0), (96, 16, 37), (3, 8, 1)])
def test_triton_group_offsets_match_reference(G, row_tile, tiles):
    g = torch.Generator().manual_seed(G)
    rows = torch.randint(0, 5, (G,), generator=g) * row_tile
    rows[1] = 0  # an empty group
    want = group_offsets(rows, row_tile, tiles, backend="torch")
    for group_rows in (rows.to(DEV), rows.int().to(DEV)):
        got = group_offsets(group_rows, row_tile, tiles, backend="triton")
        for a, b in zip(got, want):
            assert a.dtype == torch.int32 and torch.equal(a.cpu(), b)


@triton_cpu
@pytest.mark.parametrize("row_tile", [1, 8])
def test_triton_dispatcher_plan_equals_the_torch_one(row_tile):
    """LocalTokenDispatcher with the Triton plan: the same grouped rows, counts and handle as with the reference."""
    from k3train.parallel.token_dispatcher import LocalTokenDispatcher

    experts = experts_of(45, 12, 3, seed=row_tile, skew=True)
    z = torch.randn(45, 16, generator=torch.Generator().manual_seed(2)).to(DEV)
    (rows, counts, handle), (rows_t, counts_t, handle_t) = (
        LocalTokenDispatcher(12, plan_backend=b).dispatch(z, experts, row_tile) for b in ("torch", "triton"))
    assert torch.equal(rows, rows_t) and torch.equal(counts, counts_t)
    for name in ("order", "inverse", "tokens_per_expert", "pad_rows"):
        a, b = getattr(handle, name), getattr(handle_t, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    tiles = rows.shape[0] // row_tile if row_tile > 1 else 0
    for layout in (handle.layout, handle_t.layout):  # the plan's layout is group_offsets' of its group rows
        for a, b in zip(layout, group_offsets(counts.cpu(), row_tile, tiles, backend="torch")):
            assert (a is None and row_tile == 1) or torch.equal(a.cpu(), b)


@triton_cpu
def test_triton_custom_op_registration():
    """k3::moe_routing_plan and k3::moe_group_offsets: schema and fake shapes (what torch.compile relies on) agree with the kernels."""
    keys = experts_of(21, 8, 2, seed=3).flatten()
    torch.library.opcheck(torch.ops.k3.moe_routing_plan, (keys, 8, 4, layout_rows(keys.numel(), 8, 4)))
    torch.library.opcheck(torch.ops.k3.moe_group_offsets, (torch.tensor([4, 0, 8, 4], device=DEV), 4, 6))


def test_triton_cpu_subprocess():
    """Runs the Triton tests above under the interpreter when this process could not."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("row_tile", [1, 128])
def test_gpu_bench_dims(row_tile):
    """bench-1B's routing (16384 tokens, 8 of 128 experts, skewed and not): the kernels equal the reference, plan and
    group offsets."""
    for skew in (False, True):
        experts = experts_of(16384, 128, 8, seed=row_tile, skew=skew, device="cuda")
        want = routing_plan(experts, 128, row_tile, backend="torch")
        got = routing_plan(experts, 128, row_tile)
        for name, a, b in zip(want._fields, got, want):
            assert (a is None and b is None) or torch.equal(a, b), (name, skew)
        tiles = layout_rows(experts.numel(), 128, row_tile) // row_tile
        for a, b in zip(group_offsets(got.group_rows, row_tile, tiles),
                        group_offsets(got.group_rows, row_tile, tiles, backend="torch")):
            assert torch.equal(a, b), skew
