"""GPU smoke test of the trainer: k3_tiny_kernel (K3 head dims) on CUDA in bf16, through the Triton
KDA kernel, for a few steps on the embedded corpus. Run with ``pytest -m gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_kernel_trains_on_gpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "k3train.train", "model=k3_tiny_kernel", "train.device=cuda", "train.steps=30",
         "train.global_batch_size=8", "train.micro_batch_size=8", "data.seq_len=512", "train.eval_every=15",
         "train.save_every=15", "logging.wandb=false", "optim.lr=3e-3", f"train.out_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, (train[0]["loss"], train[-1]["loss"])
    assert train[-1]["mfu"] is not None and train[-1]["mfu"] > 0
    print(proc.stdout[-1500:])
