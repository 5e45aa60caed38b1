"""Training runs with bf16 parameters and fp32 main weights (``precision.dtype=bf16``, whose
``precision.params=auto`` is bf16) on CPU, against the fp32 run and against themselves.

- one rank tracks the fp32 run (measured: 0.4% apart after 6 steps; held to 1%), and its checkpoints
  hold the fp32 main weights, not their bf16 rounding;
- DP=2 over gloo (the gradient buckets' all-reduces start during the last backward) matches one rank
  (measured: equal; held to 1e-5 like the fp32 runs);
- a resume from its step-3 checkpoint is bit-exact: losses and every checkpoint tensor at step 6;
- an fp32-parameter checkpoint resumes with bf16 parameters: the first resumed loss is the fp32 run's at
  that step to 1e-3 (the same weights, computed in bf16; the step-1 losses of the two runs differ by
  3e-6), which it would not be were the bf16 weights not refreshed from the loaded ones (the initial
  weights' loss is 0.3% higher).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from parallel_runs import STEPS, assert_close_losses
from test_training_helpers import checkpoint_tensors, losses, torchrun, train

BF16 = "precision.dtype=bf16"


@pytest.fixture(scope="module")
def single_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_bf16")
    train(out, *STEPS, BF16)
    return out


def _resume_from(run, step: int, out, *overrides: str):
    ckpt = out / "checkpoints"
    shutil.copytree(run / "checkpoints" / f"step_{step:08d}", ckpt / f"step_{step:08d}")
    (ckpt / "latest").write_text(f"step_{step:08d}")
    proc = train(out, *STEPS, "logging.console=true", *overrides)
    assert "resumed from" in proc.stdout


def test_bf16_params_track_fp32_and_checkpoint_the_main_weights(single, single_bf16, tmp_path):
    got, ref = losses(single_bf16), losses(single)
    assert sorted(got) == list(range(1, 7))
    assert_close_losses(got, ref, range(1, 7), 1e-2)
    assert got != ref
    tensors = checkpoint_tensors(single_bf16 / "checkpoints" / "step_00000006", tmp_path)
    weights = {k: t for k, t in tensors.items() if k.startswith("model.") and t.is_floating_point()}
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    rounded = [k for k, t in weights.items() if not torch.equal(t, t.bfloat16().float())]
    assert len(rounded) > len(weights) // 2, rounded  # main weights, not the bf16 compute copies


def test_dp2_bf16_params_matches_one_rank(single_bf16, tmp_path):
    torchrun(tmp_path, *STEPS, BF16)
    assert_close_losses(losses(tmp_path), losses(single_bf16), range(1, 7), 1e-5)


def test_bf16_params_resume_is_bit_exact(single_bf16, tmp_path):
    _resume_from(single_bf16, 3, tmp_path, BF16)
    got, ref = losses(tmp_path), losses(single_bf16)
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == ref[s] for s in got), (got, ref)
    a = checkpoint_tensors(single_bf16 / "checkpoints" / "step_00000006", tmp_path)
    b = checkpoint_tensors(tmp_path / "checkpoints" / "step_00000006", tmp_path)
    assert set(a) == set(b) and any(k.startswith("optim.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_fp32_checkpoint_resumes_with_bf16_params(single, tmp_path):
    _resume_from(single, 3, tmp_path, BF16, "train.exit_after_steps=1")
    got, ref = losses(tmp_path), losses(single)
    assert sorted(got) == [4]
    assert_close_losses(got, ref, (4,), 1e-3)
