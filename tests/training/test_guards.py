"""Issue 14 item 1: a diverged run must stop with an error, not finish "successfully".

Unit tests of the step guard (skips, streak limit, loss spikes), and one end-to-end run at
optim.lr=1e5 whose gradients are NaN from step 2 on.
"""

from __future__ import annotations

import json
import pytest

from k3train.training.guards import StepGuard, TrainingStopped
from test_training_helpers import train


def _guard(**kw) -> StepGuard:
    args = dict(max_consecutive_skips=2, spike_factor=0.0, spike_window=4, spike_action="skip")
    args.update(kw)
    return StepGuard(**args)


def test_non_finite_loss_or_grads_are_skipped_and_a_streak_stops_the_run():
    g = _guard()
    assert g.check(3.0, 1.0) is None
    g.update(1, None)
    assert g.check(float("nan"), 1.0) == "non-finite loss"
    assert g.check(3.0, float("inf")) == "non-finite gradients"
    g.update(2, "non-finite gradients")
    g.update(3, "non-finite gradients")
    assert not g.healthy and g.consecutive == 2
    with pytest.raises(TrainingStopped, match=r"train\.max_consecutive_skips=2") as err:
        g.update(4, "non-finite gradients")
    assert "steps 2-4" in str(err.value) and "\n" not in str(err.value)


def test_a_healthy_step_ends_the_streak():
    g = _guard()
    g.update(1, "non-finite gradients")
    g.update(2, "non-finite gradients")
    g.update(3, None)
    assert g.healthy and g.consecutive == 0
    g.update(4, "non-finite gradients")
    g.update(5, "non-finite gradients")  # 2 in a row again: still allowed


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_loss_spike_against_the_median_of_recent_healthy_steps(action):
    g = _guard(spike_factor=3.0, spike_action=action)
    for step, loss in enumerate([4.0, 3.0, 2.0], start=1):
        g.update(step, g.check(loss, 1.0), loss)
    assert g.check(30.0, 1.0) is None  # the window (4 steps) is not full yet: no spike verdict
    g.update(4, None, 9.0)
    assert g.check(10.0, 1.0) is None  # 3 x median(4, 3, 2, 9) = 10.5
    assert g.check(11.0, 1.0) == "loss spike"
    if action == "stop":
        with pytest.raises(TrainingStopped, match="loss_spike_action"):
            g.update(5, "loss spike", 11.0)
    else:
        g.update(5, "loss spike", 11.0)
        assert g.consecutive == 1 and list(g.history) == [4.0, 3.0, 2.0, 9.0]


def test_state_round_trips():
    g = _guard(spike_factor=3.0)
    for step, loss in enumerate([4.0, 3.0, 2.0, 5.0], start=1):
        g.update(step, None, loss)
    h = _guard(spike_factor=3.0)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert list(h.history) == list(g.history) == [4.0, 3.0, 2.0, 5.0]
    assert h.check(12.0, 1.0) == "loss spike"


def test_diverged_run_stops_with_an_error_and_keeps_latest_healthy(tmp_path):
    proc = train(tmp_path, "train.steps=12", "train.save_every=1", "train.log_every=5", "optim.lr=1e5",
                 "train.max_consecutive_skips=3", "optim.warmup_fraction=0", check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("k3train:") and "train.max_consecutive_skips=3" in err, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = {r["step"]: r for r in rows if r["kind"] == "train"}
    skipped = sorted(s for s, r in train_rows.items() if r["skipped"])
    assert skipped == [2, 3, 4, 5], sorted(train_rows)  # every skipped step logged, not only every 5th
    assert all(train_rows[s]["skip_reason"] for s in skipped)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000001"], ckpts  # nothing written once the steps were being skipped
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
