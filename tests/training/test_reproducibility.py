"""Two identical CPU runs of the trainer with the default optimizer (per-head Muon + QK-clip) give
bit-identical losses and checkpoints (weights and optimizer state), whatever Python's string-hash
seed: nothing on the training path may depend on set/dict order of strings or on object addresses.

The runs use the default ``train.deterministic=false`` and two intra-op threads (the trainer's own
defaults on a 2-core machine, not the test helper's one thread), and QB updated within the step
(the README recipe's ``model.qb_updates_per_step`` and ``model.qb_rescore_stride``).
"""

from __future__ import annotations

import torch

from test_training_helpers import FAST, checkpoint_tensors, losses, train

STEPS = 4
BASE = [o for o in FAST if not o.startswith("train.deterministic=")] + [
    "train.deterministic=false", "model.qb_updates_per_step=2", "model.qb_rescore_stride=1",
    f"train.steps={STEPS}", f"train.save_every={STEPS}", "train.log_every=1"]


def test_muon_runs_are_bit_identical_across_hash_seeds(tmp_path):
    runs = {}
    for seed in ("0", "4242"):
        out = tmp_path / f"hashseed_{seed}"
        train(out, base=BASE, env={"PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "2"})
        runs[seed] = out
    a, b = (losses(out) for out in runs.values())
    assert sorted(a) == list(range(1, STEPS + 1)) and a == b, (a, b)
    ckpt = f"checkpoints/step_{STEPS:08d}"
    ta, tb = (checkpoint_tensors(out / ckpt, out) for out in runs.values())
    assert set(ta) == set(tb) and any(k.startswith("optim.") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
