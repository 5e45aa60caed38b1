"""A few k3_tiny steps: Muon lowers the loss more than AdamW, each at its tuned LR.

LRs come from the sweep in ``tiny_training.py`` (6 steps, one fixed batch of 2x16 tokens,
weight decay 0.1; see docs/muon_notes.md for the table): both optimizers do best at
lr = 5e-2 among {3e-3, 1e-2, 2e-2, 3e-2, 5e-2, 1e-1}. The test runs 4 steps to stay cheap
(sweep at step 4: AdamW 3.49, Muon 0.10).
"""

import pytest

pytest.importorskip("k3train.model.k3", reason="k3train.model.k3 (the K3 model) is not importable")
pytest.importorskip("k3train.optim.builder", reason="k3train.optim.builder (the optimizer seam) is not importable")

from tiny_training import train  # noqa: E402

TUNED_LR = {"adamw": 5e-2, "muon": 5e-2}
STEPS = 4


def test_muon_beats_adamw_on_k3_tiny():
    adamw = train("adamw", TUNED_LR["adamw"], STEPS)
    muon = train("muon", TUNED_LR["muon"], STEPS)
    print(f"k3_tiny {STEPS} steps: adamw {adamw[0]:.3f}->{adamw[-1]:.3f}, muon {muon[0]:.3f}->{muon[-1]:.3f}")
    assert adamw[0] == pytest.approx(muon[0])  # same init, same batch
    assert muon[-1] < adamw[-1] - 1.0, (adamw, muon)
