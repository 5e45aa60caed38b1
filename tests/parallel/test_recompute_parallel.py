"""Activation recompute (``train.recompute=full``) under tensor, expert and context parallelism (2 gloo
ranks) and pipeline parallelism (the trainer at parallel.pipeline=2): the same as ``none`` bit for bit.

The replayed layers repeat their collectives in the backward (TP all-reduces, EP all-gather and
all-to-alls, CP's all-gathers and KDA state passing); every rank replays the same layers in the same
order, so they pair up. Per rank: loss, every gradient and the expert-load counts equal ``none``'s.
"""

from __future__ import annotations

import torch

from multiprocess import run_ranks
from test_training_helpers import losses, torchrun

LAYOUTS = {"tp2": {"tensor": 2, "expert_tensor": 2}, "ep2_balanced": {"expert": 2, "ep_dispatcher": "balanced"},
           "cp2": {"context": 2}}


def _rank(rank: int, world: int) -> None:
    from megatron.core import parallel_state

    for layout in LAYOUTS:  # one spawn: the processes start once
        _check(rank, layout)
        parallel_state.destroy_model_parallel()


def _check(rank: int, layout: str) -> None:
    from k3train.config.schema import ModelConfig, ParallelConfig
    from k3train.model.k3 import K3Model
    from k3train.parallel.state import init_parallel
    from k3train.training.recompute import apply_recompute

    groups = init_parallel(ParallelConfig(**LAYOUTS[layout]), torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    tokens, labels = torch.randint(0, 512, (2, 48), generator=g), torch.randint(0, 512, (2, 48), generator=g)
    pos = torch.arange(48).repeat(2, 1)
    pos[0, 20:] = torch.arange(28)  # two documents in row 0 (the second crosses CP's chunk edges)
    runs = []
    for policy in ("none", "full"):
        torch.manual_seed(7)
        model = K3Model(ModelConfig(), groups, ep_dispatcher=LAYOUTS[layout].get("ep_dispatcher", "alltoall"))
        apply_recompute(model, policy)
        shard = model.context
        loss = model(*((tokens, pos, labels) if shard is None else (shard.split(t) for t in (tokens, pos, labels))))
        loss.backward()
        runs.append((loss.detach(), model))
    (ref_loss, ref), (loss, got) = runs
    assert torch.equal(loss, ref_loss), (layout, rank, loss, ref_loss)
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), (layout, rank, name)
    for a, b in zip(got.moe_layers(), ref.moe_layers()):
        assert torch.equal(a.load.tokens, b.load.tokens) and a.load.computed == b.load.computed, (layout, rank)


def test_full_recompute_matches_none_at_tp2_ep2_cp2():
    run_ranks(2, _rank)


def test_pipeline_full_recompute_matches_none(tmp_path):
    steps = ("train.steps=2", "train.save_every=0", "train.log_every=1", "parallel.pipeline=2",
             "parallel.pipeline_layout=[5,4]")
    torchrun(tmp_path / "none", *steps)
    torchrun(tmp_path / "full", *steps, "train.recompute=full")
    ref, got = losses(tmp_path / "none"), losses(tmp_path / "full")
    assert sorted(got) == [1, 2] and got == ref, (got, ref)
