"""Checkpoint checksums, and the choice of the checkpoint to resume from.

Every checkpoint directory holds ``checksums.json``: the size and SHA-256 of each file, written by
the main rank after all shards are on disk and before the directory is renamed into place.
``verify_checkpoint`` re-reads the files and names the first that does not match.

``train.resume=auto`` tries the checkpoint ``latest`` names, then older ones, newest first: a
corrupt one is reported in a one-line warning and skipped. An explicit ``train.resume=<path>``
that is corrupt is a one-line ``CheckpointError``. In multi-rank runs rank 0 verifies and
broadcasts its choice, so the files are read once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from k3train.training.checkpoint import LATEST, CheckpointError

MANIFEST = "checksums.json"
# What a checkpoint written before checksums existed must still hold.
REQUIRED = ("common.pt", "metadata.json", ".metadata")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(ckpt: Path) -> None:
    """Write ``ckpt/checksums.json`` for every file in ``ckpt`` (atomically)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(ckpt.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = ckpt / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1))
    os.replace(tmp, ckpt / MANIFEST)


def verify_checkpoint(ckpt: Path) -> Optional[str]:
    """None when ``ckpt`` is intact, else a short description of the first problem found."""
    if not ckpt.is_dir():
        return "the directory does not exist"
    manifest = ckpt / MANIFEST
    if not manifest.is_file():  # written before checksums existed: check what can be checked
        missing = [n for n in REQUIRED if not (ckpt / n).is_file()]
        return f"{missing[0]} is missing" if missing else None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in sorted(files.items()):
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _candidates(run_dir: Path) -> tuple[list[Path], list[str]]:
    """Checkpoints newest first, starting at the one ``latest`` names; and notes on a bad pointer."""
    root = run_dir / "checkpoints"
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name, reverse=True)
    pointer = root / LATEST
    if not pointer.exists():
        return steps, []
    named = root / pointer.read_text().strip()
    if not named.is_dir():
        return steps, [f"{pointer} names {named.name}, which does not exist"]
    return [named] + [p for p in steps if p.name < named.name], []


def _choose_auto(run_dir: Path) -> Optional[Path]:
    paths, notes = _candidates(run_dir)
    if not paths:
        if notes:
            raise CheckpointError(f"{notes[0]} and there is no other checkpoint; restore it, or delete the pointer "
                                  f"to start afresh")
        return None
    rejected = list(notes)
    for path in paths:
        problem = verify_checkpoint(path)
        if problem is None:
            for note in rejected:
                print(f"k3train: warning: {note}; resuming from the newest valid checkpoint, {path.name}",
                      file=sys.stderr, flush=True)
            return path
        rejected.append(f"checkpoint {path} is corrupt ({problem})")
    raise CheckpointError(f"no valid checkpoint in {run_dir / 'checkpoints'}: " + "; ".join(rejected)
                          + "; restore them, or use another train.out_dir")


def _choose(run_dir: Path, resume: str) -> Optional[Path]:
    if resume == "none":
        return None
    if resume == "auto":
        return _choose_auto(run_dir)
    path = Path(resume)
    problem = verify_checkpoint(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is corrupt ({problem}); give train.resume another checkpoint, "
                              f"or train.resume=auto to take the newest valid one")
    return path


def resume_checkpoint(run_dir: Path, resume: str, groups=None, device: Optional[torch.device] = None
                      ) -> Optional[Path]:
    """The checkpoint ``train.resume`` selects (verified), or None for a fresh start.

    With ``groups`` of several ranks, rank 0 chooses and the others follow (or raise with it).
    """
    if groups is None or groups.world_size == 1:
        return _choose(run_dir, resume)
    choice, error = None, None
    if groups.is_main:
        try:
            choice = _choose(run_dir, resume)
        except CheckpointError as err:
            error = err
    # -1: error, 0: fresh start, else 1 + the step of the chosen step_* directory (1 for an explicit path)
    auto = resume == "auto"
    code = -1 if error else 0 if choice is None else 1 + int(choice.name.split("_")[-1]) if auto else 1
    flag = torch.tensor([code], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    if error is not None:
        raise error
    code = int(flag.item())
    if code == -1:
        raise CheckpointError("rank 0 found no usable checkpoint (its error line says why)")
    if code == 0:
        return None
    return run_dir / "checkpoints" / f"step_{code - 1:08d}" if auto else Path(resume)
