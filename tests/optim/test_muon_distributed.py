"""Muon and QK-clip over 2 (and 4) gloo ranks equal the 1-rank optimizer."""

import torch
import torch.distributed as dist

from multiprocess import run_ranks
from k3train.config.schema import OptimConfig
from k3train.optim.muon import _Bucket, assign_blocks, build_muon
from k3train.optim.qk_clip import apply_qk_clip
from standins import SPECS, StandInGatedMLA, StandInModel, shard

STEPS = (11, 12, 13)


def _cfg():
    return OptimConfig(name="muon", lr=0.02, weight_decay=0.1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _reference(seed):
    ref = StandInModel(seed=seed)
    opt = build_muon(ref.named_parameters(), _cfg())
    for s in STEPS:
        ref.set_grads(s)
        opt.step()
    return ref


def _check_tp_dp(rank, tp_rank, tp_size, tp_group, dp_group, seed=7):
    ref = _reference(seed)
    m = StandInModel(seed=seed, tp_rank=tp_rank, tp_size=tp_size)
    opt = build_muon(m.named_parameters(), _cfg(), dp_group=dp_group, tp_group=tp_group)
    for s in STEPS:
        m.set_grads(s, tp_rank, tp_size)
        opt.step()
    for name in SPECS:
        want = shard(name, getattr(ref, name).detach(), tp_rank, tp_size)
        err = _rel(getattr(m, name).detach(), want)
        assert err <= 1e-5, (rank, name, err)
    return opt


def _dp_worker(rank, world):
    opt = _check_tp_dp(rank, 0, 1, None, dist.group.WORLD)
    info = opt.last_step_info
    # the NS work was really split: each rank orthogonalized about half the blocks
    assert 0 < info["ns_blocks_local"] < info["ns_blocks_total"], info
    counts = torch.tensor([info["ns_blocks_local"]])
    dist.all_reduce(counts)
    assert counts.item() == info["ns_blocks_total"]

    # QK-clip: per-head maxima differ between ranks; the MAX all-reduce makes both clip alike
    mla = StandInGatedMLA(seed=3)
    ref = StandInGatedMLA(seed=3)
    local = torch.tensor([50.0, 150.0, 90.0]) if rank == 0 else torch.tensor([120.0, 10.0, 95.0])
    mla.max_logit.copy_(local)
    ref.max_logit.copy_(torch.tensor([120.0, 150.0, 95.0]))
    rep = apply_qk_clip(mla, tau=100.0, group=dist.group.WORLD)
    apply_qk_clip(ref, tau=100.0)
    assert rep["num_clipped_heads"] == 2 and rep["max_logit"] == 150.0
    for a, b in zip(mla.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def _tp_worker(rank, world):
    opt = _check_tp_dp(rank, rank, world, dist.group.WORLD, None)
    # a non-finite gradient on one TP rank skips the step on every rank
    m = StandInModel(seed=1, tp_rank=rank, tp_size=world)
    opt = build_muon(m.named_parameters(), _cfg(), tp_group=dist.group.WORLD)
    m.set_grads(1, rank, world)
    opt.step()
    before = [p.detach().clone() for p in m.parameters()]
    m.set_grads(2, rank, world)
    if rank == 1:
        m.o.grad[0, 0] = float("nan")
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    assert opt.last_step_skipped and any("non-finite" in str(x.message) for x in w)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def _dp2_tp2_worker(rank, world):
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % 2, rank // 2
    _check_tp_dp(rank, tp_rank, 2, tp_groups[dp_rank], dp_groups[tp_rank])


def test_muon_dp2_equals_single_rank_and_qk_clip_allreduce():
    run_ranks(2, _dp_worker)


def test_muon_tp2_equals_single_rank():
    run_ranks(2, _tp_worker)


def test_muon_dp2_tp2_equals_single_rank():
    run_ranks(4, _dp2_tp2_worker)


def test_block_assignment_balances_cost():
    # bench-1B-like buckets: 24 expert calls, a big KDA per-head bucket, whole matrices, small ones
    buckets = [_Bucket((256, 512), 5, [i], [256 if i % 2 else 128]) for i in range(24)]
    buckets += [_Bucket((128, 1024), 5, [24], [216]), _Bucket((1024, 1024), 5, [25, 26], [13, 13]),
                _Bucket((1024, 4864), 5, [27], [3]), _Bucket((8, 1024), 5, [28], [9]), _Bucket((64, 64), 5, [29], [3])]
    work = [b.num_blocks * b.block_cost for b in buckets]
    for dp in (1, 2, 3, 8, 64):
        counts = assign_blocks(buckets, dp, call_overhead=0.0)
        for b, c in zip(buckets, counts):
            assert len(c) == dp and sum(c) == b.num_blocks and min(c) >= 0
        loads = [sum(c[r] * b.block_cost for b, c in zip(buckets, counts)) for r in range(dp)]
        share = sum(work) / dp
        assert max(loads) <= share + max(min(w, share) for w in work), (dp, loads)
        if dp > 1:  # small buckets stay whole: fewer calls than splitting everything
            calls = sum(1 for c in counts for x in c if x)
            assert calls < len(buckets) * min(dp, 3)
    # a bucket bigger than a rank's share is cut into about equal pieces
    big = [_Bucket((256, 512), 5, [0], [800])]
    assert sorted(assign_blocks(big, 4)[0]) == [200, 200, 200, 200]
