"""Issue 14 item 3: corrupt checkpoints are found by their checksums.

``train.resume=auto`` reports a corrupt newest checkpoint in one line and resumes from the newest valid
one; an explicit ``train.resume=<path>`` that is corrupt is a one-line error.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from k3train.training.integrity import MANIFEST, resume_checkpoint, verify_checkpoint
from test_training_helpers import losses, train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(out, "train.steps=4", "train.save_every=2", "train.log_every=1")
    return out


def _shard(ckpt):
    return sorted(ckpt.glob("*.distcp"))[0]


def _truncate(ckpt):
    f = _shard(ckpt)
    os.truncate(f, f.stat().st_size // 2)


def _zero(ckpt):
    f = _shard(ckpt)
    f.write_bytes(bytes(f.stat().st_size))


def _delete_common(ckpt):
    (ckpt / "common.pt").unlink()


def _flip_64_bytes(ckpt):
    f = _shard(ckpt)
    data = bytearray(f.read_bytes())
    rng = random.Random()
    for i in rng.sample(range(len(data)), 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


CORRUPTIONS = {"truncated": _truncate, "zeroed": _zero, "no_common": _delete_common, "flipped": _flip_64_bytes}


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def test_every_checkpoint_has_checksums_that_verify(run):
    for step in (2, 4):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        assert (ckpt / MANIFEST).is_file()
        assert verify_checkpoint(ckpt) is None


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_found_and_auto_falls_back(run, tmp_path, kind, capsys):
    dst = _copy(run, tmp_path)
    newest = dst / "checkpoints" / "step_00000004"
    CORRUPTIONS[kind](newest)
    problem = verify_checkpoint(newest)
    assert problem, kind
    chosen = resume_checkpoint(dst, "auto")
    assert chosen == dst / "checkpoints" / "step_00000002"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "step_00000004" in warning[0] and problem in warning[0], warning


def test_corrupt_resume_end_to_end(run, tmp_path):
    dst = _copy(run, tmp_path)
    _flip_64_bytes(dst / "checkpoints" / "step_00000004")
    # auto: a warning, then the run continues from step 2 with the losses of the uninterrupted run
    proc = train(dst, "train.steps=4", "train.save_every=2", "train.log_every=1", "logging.console=true")
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout, proc.stdout[-2000:]
    assert any("corrupt" in line and "step_00000004" in line for line in proc.stderr.splitlines()), proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # no library warning around that one line
    assert verify_checkpoint(dst / "checkpoints" / "step_00000004") is None  # rewritten
    before = losses(run)
    after = losses(dst)
    assert after[3] == before[3] and after[4] == before[4]


def test_explicit_corrupt_path_is_an_error(run, tmp_path):
    from k3train.training.checkpoint import CheckpointError

    dst = _copy(run, tmp_path)
    bad = dst / "checkpoints" / "step_00000004"
    _truncate(bad)
    with pytest.raises(CheckpointError) as err:
        resume_checkpoint(dst, str(bad))
    msg = str(err.value)
    assert str(bad) in msg and "corrupt" in msg and "train.resume" in msg and "\n" not in msg
    assert resume_checkpoint(dst, str(dst / "checkpoints" / "step_00000002")) == dst / "checkpoints" / "step_00000002"


def test_all_corrupt_is_an_error(run, tmp_path):
    from k3train.training.checkpoint import CheckpointError

    dst = _copy(run, tmp_path)
    for step in (2, 4):
        _zero(dst / "checkpoints" / f"step_{step:08d}")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        resume_checkpoint(dst, "auto")
