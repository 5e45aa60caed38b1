"""Training checkpoints written before the routed experts' ``w13`` rows were interleaved resume as the original.

Such a checkpoint stores every row-interleaved tensor (``w13`` and its optimizer state) blocked, as
[E, 2, I, ℓ] with [:, 0] the gate rows (HF's w1) and [:, 1] the up rows (w3), and its common state has no
``row_interleave_layout``. ``_to_blocked_rows`` writes that format from one of today's checkpoints; a resume
from it must be the resume from the original: the same losses and, at the end, the same checkpoint tensors,
on one rank and at TP=2 (where each rank reads its share of the gate rows and of the up rows), with one line
saying that it converts. (Weights-only checkpoints: tests/convert/test_init_from_generate.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from k3train.convert.dist_checkpoint import COMMON
from k3train.training.integrity import write_checksums
from parallel_runs import STEPS
from test_training_helpers import blocked_rows, checkpoint_tensors, drop_row_layout_marker, losses, torchrun, train


def _is_w13(key: str) -> bool:
    return key.endswith(".experts.w13") or ".experts.w13." in key


def _to_blocked_rows(src: Path, run: Path, tmp: Path) -> None:
    """Checkpoint ``src`` as an older trainer wrote it, as the latest checkpoint of run directory ``run``."""
    dst = run / "checkpoints" / src.name
    dst.mkdir(parents=True)
    state = checkpoint_tensors(src, tmp, tensors_only=False)
    assert sum(_is_w13(k) for k in state) == 16  # k3_tiny: 8 MoE layers' w13 and their Muon momentum
    dcp.save({k: blocked_rows(v) if _is_w13(k) else v for k, v in state.items()},  # the RNG states' list pickled
             storage_writer=FileSystemWriter(str(dst)), planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)  # as one entry, as Megatron-Core writes a ShardedObject
    for name in (COMMON, "metadata.json"):
        shutil.copyfile(src / name, dst / name)
    drop_row_layout_marker(dst)
    write_checksums(dst)
    (run / "checkpoints" / "latest").write_text(src.name)


def _assert_same_checkpoints(a: Path, b: Path, tmp: Path) -> None:
    got, want = checkpoint_tensors(a, tmp), checkpoint_tensors(b, tmp)
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_old_checkpoint_resumes_as_the_original_on_one_rank(single, tmp_path):
    _to_blocked_rows(single / "checkpoints" / "step_00000003", tmp_path / "old", tmp_path)
    proc = train(tmp_path / "old", *STEPS)
    assert proc.stderr.count("predates interleaved expert rows") == 1, proc.stderr
    assert "converting 8 blocked tensor(s) (layers.1.mlp.experts.w13, " in proc.stderr
    got, want = losses(tmp_path / "old"), losses(single)
    assert sorted(got) == [4, 5, 6] and all(got[s] == want[s] for s in got), (got, want)
    _assert_same_checkpoints(tmp_path / "old" / "checkpoints" / "step_00000006",
                             single / "checkpoints" / "step_00000006", tmp_path)


def test_old_checkpoint_resumes_at_tp2_as_the_original(single, tmp_path):
    _to_blocked_rows(single / "checkpoints" / "step_00000003", tmp_path / "old", tmp_path)
    new = tmp_path / "new" / "checkpoints"
    shutil.copytree(single / "checkpoints" / "step_00000003", new / "step_00000003")
    (new / "latest").write_text("step_00000003")
    for run in ("old", "new"):
        torchrun(tmp_path / run, *STEPS, "parallel=tp2")
    got, want = losses(tmp_path / "old"), losses(tmp_path / "new")
    assert sorted(got) == [4, 5, 6] and got == want, (got, want)
    _assert_same_checkpoints(tmp_path / "old" / "checkpoints" / "step_00000006",
                             tmp_path / "new" / "checkpoints" / "step_00000006", tmp_path)
