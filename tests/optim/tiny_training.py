"""A few k3_tiny steps with Muon or AdamW on one fixed batch (used by a test and the LR sweep).

    PYTHONPATH=. python tests/optim/tiny_training.py          # LR sweep, prints a table

Both optimizers start from the same initialization (seeded) and see the same batch; the
builder seam (``k3train.optim.builder.build_optimizer``) makes both, so this exercises
the path the trainer uses.
"""

from __future__ import annotations

import sys
import time

import torch

from k3train.config.schema import ModelConfig, OptimConfig
from k3train.model.k3 import K3Model
from k3train.optim.builder import build_optimizer

BATCH, SEQ = 2, 16


def train(name: str, lr: float, steps: int, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    model = K3Model(ModelConfig(), linear_backend="torch")
    cfg = OptimConfig(name=name, lr=lr, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, model.cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    tokens, labels = seq[:, :-1], seq[:, 1:]
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(model(tokens, pos, labels)))
    return losses


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    torch.set_num_threads(1)
    for name, lrs in (("adamw", [3e-3, 1e-2, 3e-2, 1e-1]), ("muon", [3e-3, 1e-2, 3e-2, 1e-1])):
        for lr in lrs:
            t = time.time()
            ls = train(name, lr, steps)
            print(f"{name:6s} lr={lr:<6g} loss {ls[0]:.4f} -> {ls[-1]:.4f}  ({time.time() - t:.0f}s)  {['%.3f' % x for x in ls]}", flush=True)
