"""End-to-end CPU runs of ``python -m k3train.train`` on k3_tiny and the embedded corpus.

- 20 straight steps equal 10 steps (checkpoints written with train.async_save), a resume, and 10 more:
  losses and final weights, bit-exact;
- the loss falls;
- bad input gives a one-line error and leaves earlier checkpoints intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from test_training_helpers import FAST, REPO, checkpoint_tensors, losses, train


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(out, "train.steps=20", "train.save_every=20", "train.log_every=1")
    return out


def test_resume_is_bit_exact(straight, tmp_path):
    resumed = tmp_path / "resumed"
    # The first half writes its checkpoints asynchronously (train.async_save), the second synchronously.
    train(resumed, "train.steps=20", "train.exit_after_steps=10", "train.save_every=5", "train.log_every=1",
          "train.async_save=true")
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["latest", "step_00000005",
                                                                          "step_00000010"]
    proc = train(resumed, "train.steps=20", "train.save_every=10", "train.log_every=1", "logging.console=true")
    assert "resumed from" in proc.stdout
    # the default Quantile Balancing schedule, resolved for FAST's 2 micro-batches a step
    assert "Quantile Balancing: 2 bias updates a step, one every 1 micro-batch(es), the last after the optimizer " \
           "step; step feedback 0.5" in proc.stdout
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(1, 21))
    for step in range(1, 21):
        assert a[step] == b[step], (step, a[step], b[step])
    ta = checkpoint_tensors(straight / "checkpoints" / "step_00000020", tmp_path)
    tb = checkpoint_tensors(resumed / "checkpoints" / "step_00000020", tmp_path)
    assert set(ta) == set(tb) and any(k.startswith("optim.") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_loss_falls_and_outputs_are_written(straight):
    l = losses(straight)
    first, last = sum(l[s] for s in range(1, 4)) / 3, sum(l[s] for s in range(18, 21)) / 3
    assert first > 6.0 and last < first - 0.5, (first, last)
    row = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_gb", "expert_load_max_over_mean"):
        assert row[key] is not None, key
    assert (straight / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    assert (straight / ".hydra" / "config.yaml").exists()


def test_mxfp8_recipe_trains_like_fp32(straight, tmp_path):
    """precision=mxfp8 through the trainer (Megatron-Core linears with the emulated MXFP8 GEMMs): the
    first steps' losses are within 1% of the same run in fp32, and not equal to them."""
    out = tmp_path / "mxfp8"
    train(out, "precision=mxfp8", "train.steps=20", "train.exit_after_steps=2", "train.save_every=0",
          "train.log_every=1")
    got, ref = losses(out), losses(straight)
    assert sorted(got) == [1, 2]
    assert all(abs(got[s] - ref[s]) < 0.01 * ref[s] for s in got), (got, ref)
    assert any(got[s] != ref[s] for s in got), got


@pytest.mark.parametrize("gemm, situ", [("tiles:1", ""), ("fused:1", "; SiTU in a pass of its own")])
def test_expert_tiled_gemm_trains_like_torch(straight, tmp_path, gemm, situ):
    """precision.expert_gemm=tiles:1 or fused:1 through the trainer (rows padded per expert to 64; on CPU the
    expert-tiled kernel's torch reference, SiTU its own pass, as the start-up line says): the first steps' losses
    match the torch._grouped_mm run's to 1e-4."""
    out = tmp_path / "tiles"
    proc = train(out, f"precision.expert_gemm={gemm}", "train.steps=20", "train.exit_after_steps=3",
                 "train.save_every=0", "train.log_every=1", "logging.console=true")
    assert f"Routed experts: grouped GEMMs on {gemm} (precision.expert_gemm), each expert's rows padded to a " \
           f"multiple of 64{situ}" in proc.stdout, proc.stdout[-2000:]
    got, ref = losses(out), losses(straight)
    assert sorted(got) == [1, 2, 3]
    assert all(abs(got[s] - ref[s]) < 1e-4 for s in got), (got, ref)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("k3train:"), proc.stderr[-2000:]
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("override,needles", [
    ("model.attn_res_block_size=0", ["model.attn_res_block_size"]),
    ("model.num_experts_per_token=9", ["model.num_experts_per_token", "model.num_experts"]),
    ("model.full_attn_layers=[3,6,9]", ["model.full_attn_layers", "[4, 8, 9]"]),
    ("parallel.tensor=2", ["parallel.tensor"]),
])
def test_bad_config_is_one_line_error(tmp_path, override, needles):
    _one_line_error(train(tmp_path, "train.steps=1", override, check=False), *needles)


def test_missing_dataset_is_one_line_error(tmp_path):
    _one_line_error(train(tmp_path, "train.steps=1", f"data.paths=[{tmp_path}/nope]", check=False), "nope")


def test_vocab_smaller_than_tokenizer_is_one_line_error(tmp_path):
    from k3train.config.schema import DataConfig
    from k3train.data.datasets import resolve_data

    data = resolve_data(DataConfig(cache_dir=os.path.expanduser("~/.cache/k3train")), 512)
    proc = train(tmp_path, "train.steps=1", "model.vocab_size=256", f"data.paths=[{data.paths[0]}]",
                 f"data.tokenizer={data.tokenizer_path}", check=False)
    _one_line_error(proc, "model.vocab_size")


def test_checkpoint_from_other_model_config_is_refused_and_kept(tmp_path):
    run = tmp_path / "run"
    train(run, "train.steps=2", "train.save_every=2")
    before = sorted(p.name for p in (run / "checkpoints" / "step_00000002").iterdir())
    proc = train(run, "train.steps=4", "model.dense_intermediate_size=128", check=False)
    _one_line_error(proc, "dense_intermediate_size", "different model config")
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000002").iterdir()) == before
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "k3train.train", *FAST, f"train.out_dir={tmp_path}",
                             "train.steps=1000", "train.save_every=0", "train.log_every=1"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    saved = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = int(saved.split("_")[1])
    assert 2 <= step < 1000 and step == max(losses(tmp_path))
