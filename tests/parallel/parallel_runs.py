"""The run length shared by the multi-rank training tests and their one-rank reference, and the
loss and optimizer-metric comparisons they use."""

import json

# One Quantile Balancing update a step: the default (after every micro-batch) routes differently when a layout
# changes a rank's micro-batch count, so runs compared across layouts fix it (a later override wins: the
# within-step updates have their own DP test, test_parallel_training.py).
STEPS = ["train.steps=6", "train.save_every=3", "train.log_every=1", "model.qb_updates_per_step=1"]
# Muon, and a QK-clip threshold some of k3_tiny's 6 MLA heads exceed (measured on one rank: all 6 at
# step 1, then 3, 3, 3, 3, 1), so that the logged figures pool clipped heads from every rank.
MUON = ["optim=muon", "optim.qk_clip_tau=0.003"]


def assert_close_losses(got: dict, ref: dict, steps, rel: float) -> None:
    for step in steps:
        assert abs(got[step] - ref[step]) <= rel * abs(ref[step]), (step, got[step], ref[step], rel)


def train_rows(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def assert_same_optimizer_metrics(got: dict, ref: dict, steps, rel: float = 1e-5) -> None:
    """Muon's update RMS and QK-clip's clipped heads and max logit (``train_rows``) as one rank logs them:
    the figures of the whole model, not of rank 0's part."""
    for step in steps:
        g, r = got[step], ref[step]
        assert g["qk_clip_heads"] == r["qk_clip_heads"], ("qk_clip_heads", step, g["qk_clip_heads"], r["qk_clip_heads"])
        for key in ("muon_update_rms", "qk_max_logit"):
            assert abs(g[key] - r[key]) <= rel * abs(r[key]), (key, step, g[key], r[key])
    assert all(ref[step]["qk_clip_heads"] > 0 for step in steps)
