"""Issue 14 items 4 and 6: one trainer per run directory, no silent overwrite, and Ctrl-C.

- a second trainer on a run directory refuses, naming the holder's pid and host; a lock left by a
  dead process on this host is taken over with a warning;
- ``train.resume=none`` on a directory that holds checkpoints is an error, not an overwrite;
- SIGINT saves and stops like SIGTERM; a second SIGINT aborts at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from k3train.training.checkpoint import remove_incomplete_saves
from k3train.training.run_dir import LOCK, RunDirError, RunDirLock, check_no_overwrite
from test_training_helpers import FAST, REPO, losses, train


def _write_lock(run, pid, host=None):
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname()}))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_held_by_a_live_process_is_refused(tmp_path):
    holder = os.getppid()  # alive, and not us
    _write_lock(tmp_path, holder)
    with pytest.raises(RunDirError) as err:
        RunDirLock(tmp_path).acquire()
    msg = str(err.value)
    assert f"pid {holder}" in msg and socket.gethostname() in msg and "\n" not in msg
    _write_lock(tmp_path, 12345, host="another-node")
    with pytest.raises(RunDirError, match="another-node"):
        RunDirLock(tmp_path).acquire()


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    dead = _dead_pid()
    _write_lock(tmp_path, dead)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "warning" in err and str(dead) in err
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_resume_none_does_not_overwrite_checkpoints(tmp_path):
    check_no_overwrite(tmp_path, "none")  # nothing there yet
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    check_no_overwrite(tmp_path, "auto")
    with pytest.raises(RunDirError) as err:
        check_no_overwrite(tmp_path, "none")
    for needle in ("train.resume=none", "step_00000004", "train.resume=auto", "train.out_dir"):
        assert needle in str(err.value)


def test_unfinished_saves_are_removed_with_a_warning(tmp_path, capsys):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_00000004").mkdir(parents=True)
    (ckpts / ".tmp_step_00000008" / "sub").mkdir(parents=True)
    (ckpts / ".tmp_step_00000008" / "sub" / "shard.distcp").write_bytes(b"x" * 3 * 2**20)
    (ckpts / ".latest.tmp").write_text("step_00000008")
    assert remove_incomplete_saves(tmp_path) == [".tmp_step_00000008", ".latest.tmp"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004"]
    err = capsys.readouterr().err
    assert ".tmp_step_00000008 (3.0 MiB)" in err and "did not finish" in err
    assert remove_incomplete_saves(tmp_path) == [] and remove_incomplete_saves(tmp_path / "new") == []


# Runs the trainer with every checkpoint save first waiting up to a minute once the file named by
# argv[1] exists: the test then holds the trainer inside a save for as long as it needs.
_HELD_SAVES = """
import os, runpy, sys, time
from k3train.training.loop import Trainer
marker, save = sys.argv.pop(1), Trainer.save
def held_save(self):
    deadline = time.monotonic() + 60
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    save(self)
Trainer.save = held_save
runpy.run_module("k3train.train", run_name="__main__")
"""


def _start(run, *overrides, hold_saves_while=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    entry = ["-m", "k3train.train"] if hold_saves_while is None else ["-c", _HELD_SAVES, str(hold_saves_while)]
    return subprocess.Popen([sys.executable, *entry, *FAST, f"train.out_dir={run}", "train.steps=1000",
                             "train.save_every=0", "train.log_every=1", *overrides],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(run, n):
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.3)


def test_second_trainer_refuses_and_sigint_saves_and_stops(tmp_path):
    run = tmp_path / "run"
    first = _start(run)
    try:
        _wait_for_steps(run, 2)
        second = train(run, "train.steps=3", check=False)
        assert second.returncode != 0
        err = second.stderr.strip().splitlines()[-1]
        assert err.startswith("k3train: error:") and f"pid {first.pid}" in err and socket.gethostname() in err, err
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-2000:]
    saved = (run / "checkpoints" / "latest").read_text().strip()
    assert int(saved.split("_")[1]) == max(losses(run)) >= 2
    assert not (run / LOCK).exists()
    # the checkpoint is there now: a fresh run over it is refused rather than overwriting it
    proc = train(run, "train.steps=3", "train.resume=none", check=False)
    assert proc.returncode != 0 and "train.resume=none" in proc.stderr.strip().splitlines()[-1]


def test_second_sigint_aborts(tmp_path):
    run, hold = tmp_path / "run", tmp_path / "hold_saves"
    proc = _start(run, "train.save_every=1", hold_saves_while=hold)
    try:
        _wait_for_steps(run, 2)
        hold.touch()  # from here every save waits: the trainer is still alive when the second SIGINT comes
        proc.send_signal(signal.SIGINT)
        # Two signals that arrive before Python has run the handler of the first count as one: press
        # again once the trainer has said it will save.
        first = [proc.stderr.readline()]
        while first[-1] and "Ctrl-C again aborts" not in first[-1]:
            first.append(proc.stderr.readline())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first[-1].startswith("k3train: SIGINT: saving a checkpoint after this step"), first
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith("k3train: aborted"), err[-2000:]
    assert not (run / LOCK).exists()
