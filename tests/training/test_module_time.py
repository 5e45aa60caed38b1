"""module_time: profiler time charged to the module that ran it, forward and backward (CPU self time;
the GPU path differs only in reading each op's kernels)."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from k3train.config.schema import ModelConfig
from k3train.model.k3 import K3Model
from k3train.training.module_time import OUTSIDE, PREFIX, ROOT_PREFIX, module_ranges, time_by_module


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Act(nn.Module):
    def forward(self, x):
        return Square.apply(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(32, 32), Act()

    def forward(self, x):
        return self.act(self.lin(x))


class Net(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.a, self.b, self.head = Block(), Block(), nn.Linear(32, 4)
        self.recompute = recompute

    def forward(self, x):
        x = self.a(x)
        x = checkpoint(self.b, x, use_reentrant=False) if self.recompute else self.b(x)
        return self.head(x)


def _profile(model, x):
    """Events of one forward and backward of mean(model(x)²) under ``module_ranges(model)``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, module_ranges(model):
        model(x).square().mean().backward()
    return prof.events()


def test_backward_ops_are_charged_to_the_forward_module():
    torch.manual_seed(0)
    events = _profile(Net(recompute=False), torch.randn(16, 32))
    rows = time_by_module(events, device=False)
    assert set(rows) == {"Block/Linear", "Block/Act", "Linear", OUTSIDE}  # Net runs no op of its own
    # forward: 2 blocks' linears and squares, the head; backward: their grads land on the same rows
    for path in ("Block/Linear", "Block/Act", "Linear"):
        assert rows[path]["fwd_n"] > 0 and rows[path]["bwd_n"] > 0, path
    # the custom Function's backward (one mul chain) is charged to Act, not to the Linear before it
    square_bwd = [e for e in events if e.name == "SquareBackward"]
    assert len(square_bwd) == 2
    # nothing is lost: every op's self time is in exactly one row (the ranges' own time excluded)
    total = sum(e.self_cpu_time_total for e in events if not e.name.startswith((PREFIX, ROOT_PREFIX))) / 1e3
    assert abs(sum(r["fwd_ms"] + r["bwd_ms"] for r in rows.values()) - total) < 1e-6 * max(total, 1)
    # the loss (square, mean) ran outside the model, forward and backward
    assert rows[OUTSIDE]["fwd_n"] > 0 and rows[OUTSIDE]["bwd_n"] > 0


def test_recomputed_forward_is_charged_to_its_module_in_the_backward():
    """Non-reentrant checkpoint replays Block b in the backward and may stop it early (an exception
    inside the forward): the ranges must still close, or later ops would land in a stale module."""
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    plain = time_by_module(_profile(Net(recompute=False), x), device=False)
    replayed = time_by_module(_profile(Net(recompute=True), x), device=False)
    assert set(replayed) == set(plain)
    # the replayed linear's forward ops are in the backward, on its row
    assert replayed["Block/Linear"]["bwd_n"] > plain["Block/Linear"]["bwd_n"]
    # the head's backward, after the replay, is still the head's
    assert replayed["Linear"]["bwd_n"] == plain["Linear"]["bwd_n"]


def test_labels_name_what_runs_outside_the_model():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    with profile(activities=[ProfilerActivity.CPU]) as prof, module_ranges(model):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    rows = time_by_module(prof.events(), device=False, labels=("Optimizer.step#",))
    assert rows["Optimizer.step#AdamW.step"]["fwd_n"] > 0
    assert rows["Linear"]["bwd_n"] > 0


def test_k3_tiny_step_by_module():
    """The model's mixers, MoE parts and AttnRes each get their forward and their backward; what
    no module claims is the gradient accumulation (AccumulateGrad), a small part."""
    cfg = ModelConfig()  # k3_tiny
    torch.manual_seed(0)
    model = K3Model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 32))
    with profile(activities=[ProfilerActivity.CPU]) as prof, module_ranges(model):
        model(x, labels=x).backward()
    events = prof.events()
    rows = time_by_module(events, device=False, depth=2)
    for path in ("K3Layer/KimiDeltaAttention", "K3Layer/GatedMLA", "K3Layer/LatentMoE", "K3Layer/AttnResAggregator"):
        assert rows[path]["fwd_n"] > 0 and rows[path]["bwd_n"] > 0, (path, rows.get(path))
    total = sum(r["bwd_ms"] for r in rows.values())
    assert rows.get(OUTSIDE, {"bwd_ms": 0.0})["bwd_ms"] < 0.2 * total
    # ranges closed: after the step no module range is open on the profiler's stack
    assert not any(e.name.startswith(PREFIX) and e.time_range.end < e.time_range.start for e in events)
    assert not model._forward_hooks and not model._forward_pre_hooks
