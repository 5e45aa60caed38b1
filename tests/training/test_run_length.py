"""train.keep_last prunes old checkpoints; train.exit_after_minutes leaves with a checkpoint that the
next run resumes (issue 14: time-sliced clusters)."""

from __future__ import annotations

import json

from test_training_helpers import train


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    train(tmp_path, "train.steps=5", "train.save_every=1", "train.keep_last=2")
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert (ckpts / "latest").read_text().strip() == "step_00000005"


def test_exit_after_minutes_saves_and_the_next_run_resumes(tmp_path):
    first = train(tmp_path, "train.steps=50", "train.save_every=0", "train.exit_after_minutes=0.0001",
                  "logging.console=true")
    assert "train.exit_after_minutes=0.0001: saved step 1 and stopped" in first.stdout
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    second = train(tmp_path, "train.steps=3", "train.save_every=0", "train.log_every=1", "logging.console=true")
    assert "resumed from" in second.stdout and "at step 1" in second.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"train"' in line]
    assert steps == [1, 2, 3]
