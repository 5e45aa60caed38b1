"""Whole training runs with context parallelism (``parallel.context``) against one rank, over gloo.

k3_tiny, fp32, 6 steps, on rows that pack several short documents (some cross the chunk edges:
``packed_data``). CP moves KDA's state between ranks as fp32 transitions and MLA attends over the
gathered latent, so only fp32 summation order differs from one rank (test_context_parallel.py
holds one step's loss and every gradient to 1e-5). Over a run, AdamW's sign-like first updates and
top-k routing amplify that order: measured on k3_tiny, losses agree to ≤ 2e-7 for 3 steps, then a
token flips experts and the trajectories separate (1e-4 by step 6), as for TP2
(test_parallel_training.py). Held: steps 1–2 to 1e-5 (loss and grad norm), all 6 losses to 1e-3.
The same for CP2×EP2, CP2×DP2 and PP2×CP2.
"""

from __future__ import annotations

import json

from parallel_runs import STEPS
from test_training_helpers import torchrun


def metrics(out_dir) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}


def assert_tracks(got: dict, ref: dict) -> None:
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        (loss, gnorm), (ref_loss, ref_gnorm) = got[step], ref[step]
        tol = 1e-5 if step <= 2 else 1e-3
        assert abs(loss - ref_loss) <= tol * ref_loss, ("loss", step, loss, ref_loss)
        if step <= 2:
            assert abs(gnorm - ref_gnorm) <= tol * ref_gnorm, ("grad_norm", step, gnorm, ref_gnorm)


def test_cp2_matches_one_rank(single_packed, packed_data, tmp_path):
    torchrun(tmp_path, *STEPS, *packed_data, "parallel.context=2")
    assert_tracks(metrics(tmp_path), metrics(single_packed))


def test_cp2_ep2_matches_one_rank(single_packed, packed_data, tmp_path):
    """2 ranks: each holds half of every row and half of the experts (EP spans the CP ranks)."""
    torchrun(tmp_path, *STEPS, *packed_data, "parallel.context=2", "parallel.expert=2")
    assert_tracks(metrics(tmp_path), metrics(single_packed))


def test_cp2_dp2_matches_one_rank(single_packed, packed_data, tmp_path):
    """4 ranks: two DP replicas (one micro-batch each), each row split over a CP pair."""
    torchrun(tmp_path, *STEPS, *packed_data, "parallel.context=2", nproc=4)
    assert_tracks(metrics(tmp_path), metrics(single_packed))


def test_pp2_cp2_matches_one_rank(single_packed, packed_data, tmp_path):
    """4 ranks: two pipeline stages, each row split over a CP pair (KDA state and the conv halo passed
    within a stage, the AttnRes bank of a CP rank's chunks between the stages). Measured: losses within
    1e-7 and grad norms 2e-6 over 6 steps."""
    torchrun(tmp_path, *STEPS, *packed_data, "parallel.context=2", "parallel.pipeline=2",
             "parallel.pipeline_layout=[5,4]", nproc=4)
    assert_tracks(metrics(tmp_path), metrics(single_packed))


def test_validator_names_a_sequence_that_does_not_split():
    import pytest

    from k3train.config.load import load_config
    from k3train.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"data\.seq_len=100 is not divisible by 2\*parallel\.context=8"):
        validate(load_config(["model=k3_tiny", "parallel.context=4", "data.seq_len=100"]), world_size=4)
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by parallel\.tensor\*pipeline\*context=2"):
        validate(load_config(["model=k3_tiny", "parallel.context=2"]), world_size=3)
    validate(load_config(["model=k3_tiny", "parallel.context=2", "parallel.expert=2"]), world_size=2)
