"""Helpers for tests that run ``python -m k3train.train`` in child processes on CPU (``warm_trainer``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from warm_trainer import can_fork, run_trainer

REPO = Path(__file__).resolve().parents[1]
FAST = ["model=k3_tiny", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.eval_every=0", "logging.wandb=false", "logging.console=false",
        "optim.lr=3e-3", "train.deterministic=true"]


def train(out_dir: Path, *overrides: str, check: bool = True, base: tuple[str, ...] | list[str] = FAST,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m k3train.train`` (forked from a warm server where it can be: ``warm_trainer``).
    ``env``: variables set on top of the defaults (e.g. PYTHONHASHSEED, OMP_NUM_THREADS)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [*base, f"train.out_dir={out_dir}", *overrides]
    if can_fork(env or {}):
        proc = run_trainer(argv, full_env, REPO, timeout=600)
    else:
        proc = subprocess.run([sys.executable, "-m", "k3train.train", *argv], cwd=REPO, env=full_env,
                              capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def torchrun(out_dir: Path, *overrides: str, nproc: int = 2) -> None:
    """The trainer on ``nproc`` gloo ranks with the FAST base config, as ``launch/torchrun.sh`` starts it
    (forked from a warm server: ``warm_trainer``; tests/test_launch.py runs the script itself)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = run_trainer([*FAST, f"train.out_dir={out_dir}", *overrides], env, REPO, nproc=nproc, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def checkpoint_tensors(ckpt: Path, tmp: Path, tensors_only: bool = True) -> dict:
    """Every entry of a checkpoint's shards by key, read in one process (``tensors_only``: the tensors)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) or not tensors_only}


def blocked_rows(w13: torch.Tensor) -> torch.Tensor:
    """An expert stack with interleaved rows [E, 2I, ℓ] (gate_0, up_0, gate_1, ...) in the layout checkpoints
    stored before: [E, 2, I, ℓ], [:, 0] the gate rows (HF's w1), [:, 1] the up rows (w3)."""
    return torch.stack([w13[:, 0::2], w13[:, 1::2]], dim=1).contiguous()


def drop_row_layout_marker(ckpt: Path) -> None:
    """Remove the common state's row-layout entry, as checkpoints written before it lack it."""
    from k3train.convert.dist_checkpoint import COMMON, ROW_LAYOUT, ROW_LAYOUT_KEY

    common = torch.load(ckpt / COMMON, weights_only=False)
    assert common.pop(ROW_LAYOUT_KEY) == ROW_LAYOUT
    torch.save(common, ckpt / COMMON)
