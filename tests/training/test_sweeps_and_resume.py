"""Issue 14 item 7: sweeps get one run directory per job; a resume reports the config fields that
changed and leaves no duplicate steps in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_training_helpers import FAST, REPO, train


def _train_steps(run_dir) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "train"]


def test_multirun_jobs_train_in_their_own_run_directories(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "k3train.train", "-m", *FAST, "train.steps=2", "train.log_every=1",
                           "train.save_every=0", f"train.out_dir={tmp_path}", "optim.lr=1e-3,3e-3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    jobs = sorted(p for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists())
    assert len(jobs) == 2 and [("optim.lr=0.001" in j.name or "optim.lr=1e-3" in j.name) for j in jobs].count(True) == 1
    for job in jobs:  # job 2 trained from step 1: it did not resume job 1's checkpoint
        assert _train_steps(job) == [1, 2], job
        assert (job / "checkpoints" / "latest").exists()
    assert "resumed" not in proc.stdout


def test_resume_reports_changed_fields_and_logs_each_step_once(tmp_path):
    train(tmp_path, "train.steps=4", "train.save_every=2", "train.log_every=1")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002")  # as if it died after logging step 4
    proc = train(tmp_path, "train.steps=4", "train.save_every=2", "train.log_every=1", "optim.lr=1e-3",
                 "logging.console=true")
    assert "resumed from" in proc.stdout
    assert "optim.lr: 0.003 -> 0.001" in proc.stderr and "train.log_every" not in proc.stderr
    assert _train_steps(tmp_path) == [1, 2, 3, 4]
