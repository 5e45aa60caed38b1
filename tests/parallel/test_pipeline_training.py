"""Whole training runs with pipeline parallelism against one rank, over gloo (k3_tiny, fp32, 6 steps).

test_pipeline_parallel.py holds one step's loss and every gradient to 1e-5; over a run the stages
only change fp32 summation order (gradients of rows that several chunks read add up in another
order), which AdamW and top-k routing can amplify as for TP2 (test_parallel_training.py). Measured
on k3_tiny: PP2 (1F1B, layout [5, 4]) matches one rank to 8e-8 in loss and 2.3e-7 in grad norm over
all 6 steps (with identical per-layer expert loads). Held, as for TP2 and CP2: steps 1–2 to 1e-5
(loss and grad norm), all 6 losses to 1e-3.

TP2×PP2 follows TP2's drift (its test states the bounds). It and PP2×DP2×EP2 train with Muon and
QK-clip, and their logged optimizer figures equal one rank's (``assert_same_optimizer_metrics``).

Checkpoints reshard over the pipeline: the PP2×V2 run's step-3 checkpoint resumes on one rank,
and the one-rank run's step-3 checkpoint resumes at PP2; the first resumed step equals the
original run's to 1e-5.
"""

from __future__ import annotations

import json
import shutil

from parallel_runs import MUON, STEPS, assert_same_optimizer_metrics
from test_training_helpers import torchrun, train

V2 = ("parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.pipeline_layout=[3,2,2,2]")


def metrics(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def assert_tracks(got: dict, ref: dict, steps=range(1, 7), exact=(1, 2)) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        tol = 1e-5 if step in exact else 1e-3
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= tol * ref[step]["loss"], (step, got[step], ref[step])
        if step in exact:
            assert abs(got[step]["grad_norm"] - ref[step]["grad_norm"]) <= tol * ref[step]["grad_norm"], step


def resume_from(src, step: int, dst) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name)


def test_pp2_interleaved_matches_one_rank_and_resumes_on_one_rank(single, tmp_path):
    """Rank 0 runs chunks 0 and 2, rank 1 chunks 1 and 3; every rank logs the step's loss and all
    MoE layers' expert load (gathered over PP), identical to one rank's at step 1."""
    pp = tmp_path / "pp"
    torchrun(pp, *STEPS, *V2)
    got, ref = metrics(pp), metrics(single)
    assert_tracks(got, ref)
    assert got[1]["expert_load_per_layer"] == ref[1]["expert_load_per_layer"]
    assert len(got[1]["qb_bias_range"]) == len(ref[1]["qb_bias_range"]) == 8

    one = tmp_path / "one"
    resume_from(pp, 3, one)
    proc = train(one, *STEPS, "logging.console=true")
    assert "resumed from" in proc.stdout
    assert_tracks(metrics(one), got, steps=(4, 5, 6), exact=(4,))


def test_one_rank_checkpoint_resumes_at_pp2(single, tmp_path):
    resume_from(single, 3, tmp_path)
    torchrun(tmp_path, *STEPS, "parallel.pipeline=2", "parallel.pipeline_layout=[5,4]")
    assert_tracks(metrics(tmp_path), metrics(single), steps=(4, 5, 6), exact=(4,))


def test_pp2_dp2_ep2_matches_one_rank(single_muon, tmp_path):
    """4 ranks: two stages, each a DP pair that shares out the experts (EP2 inside each stage), with Muon
    and QK-clip: rank 0 logs the update RMS and clipped heads of both stages and both EP ranks' experts."""
    torchrun(tmp_path, *STEPS, *MUON, "parallel.pipeline=2", "parallel.pipeline_layout=[5,4]", "parallel.expert=2",
             nproc=4)
    got, ref = metrics(tmp_path), metrics(single_muon)
    assert_tracks(got, ref)
    assert_same_optimizer_metrics(got, ref, range(1, 7))


def test_tp2_pp2_matches_one_rank(single_muon, tmp_path):
    """4 ranks: two stages, each layer split over a TP pair, with Muon and QK-clip (rank 0 logs the
    update RMS and clipped heads of both stages and both TP ranks' heads). TP's all-reduce order can be
    amplified over a run as in test_parallel_training.py (measured with AdamW: loss 1e-4, grad norm
    2.6e-2 at step 6; with Muon: losses within 1e-7 over all 6 steps, grad norms 1.4e-5, optimizer
    figures 3e-6), so: steps 1–2 to 1e-5 in loss and 1e-4 in grad norm, all losses to 1e-3 (the
    TP2×EP2 test's bounds)."""
    torchrun(tmp_path, *STEPS, *MUON, "parallel=tp2", "parallel.pipeline=2", "parallel.pipeline_layout=[5,4]",
             nproc=4)
    got, ref = metrics(tmp_path), metrics(single_muon)
    assert_tracks(got, ref, exact=())
    for step in (1, 2):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * ref[step]["loss"], step
        assert abs(got[step]["grad_norm"] - ref[step]["grad_norm"]) <= 1e-4 * ref[step]["grad_norm"], step
    assert_same_optimizer_metrics(got, ref, range(1, 7))


def test_validator_names_bad_pipeline_configs():
    import pytest

    from k3train.config.load import load_config
    from k3train.config.validate import ConfigError, validate

    def check(overrides, world):
        validate(load_config(["model=k3_tiny", *overrides]), world_size=world)

    with pytest.raises(ConfigError, match=r"set parallel\.pipeline_layout=\[5, 4\]"):
        check(["parallel.pipeline=2"], 2)
    with pytest.raises(ConfigError, match=r"lower parallel\.virtual_stages to at most 4"):
        check(["parallel.pipeline=2", "parallel.virtual_stages=5"], 2)
    with pytest.raises(ConfigError, match=r"not a multiple of parallel\.pipeline=2"):
        check([*V2, "train.global_batch_size=6", "train.micro_batch_size=2"], 2)
    with pytest.raises(ConfigError, match=r"model\.qb_updates_per_step=2"):
        check(["parallel.pipeline=2", "parallel.pipeline_layout=[5,4]", "model.qb_updates_per_step=2",
               "train.global_batch_size=8", "train.micro_batch_size=2"], 2)
    check([*V2, "train.global_batch_size=4", "train.micro_batch_size=2"], 2)
