"""Expert load under Quantile Balancing in the README's main job (``launch/train_tiny.sh``: k3_tiny,
the embedded corpus, 200-step schedule), cut to 30 steps.

Its recipe (docs/moe_notes.md §3): per-head Muon (the default optimizer), which leaves the unigram
phase early; a QB update after every micro-batch (8 a step) with step feedback 0.5 (both the defaults);
and the end-of-step update from the router inputs re-scored by the updated router (the script's one QB override). Measured (session 23, ``benchmarks/qb_sweep.py``
with this recipe, 100 steps): worst layer median 1.10 over steps 11–100, at most 1.16 to step 30 and 1.34 to
step 100 (without step feedback: median 1.19, at most 1.39). Muon with one update a step sits at 1.4–4 over
steps 10–30, AdamW at 2–4.
"""

from __future__ import annotations

import json
import re
import shlex

from test_training_helpers import REPO, train


def readme_recipe() -> list[str]:
    """The overrides ``launch/train_tiny.sh`` adds to the trainer's defaults (its RECIPE array)."""
    script = (REPO / "launch" / "train_tiny.sh").read_text()
    return shlex.split(re.search(r"^RECIPE=\((.*)\)$", script, re.M).group(1))


README_RUN = ["model=k3_tiny", "train.device=cpu", *readme_recipe(), "logging.wandb=false", "logging.console=false",
              "train.steps=200", "train.exit_after_steps=30", "train.log_every=1", "train.eval_every=0",
              "train.save_every=0"]


def test_readme_run_holds_k3_tiny_load_after_step_10(tmp_path):
    train(tmp_path, base=README_RUN)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    load = {r["step"]: r["expert_load_max_over_mean"] for r in rows if r["kind"] == "train"}
    assert sorted(load) == list(range(1, 31))
    late = {step: v for step, v in load.items() if step > 10}
    assert max(late.values()) <= 1.5, late
    assert all(len(r["expert_load_per_layer"]) == 8 for r in rows if r["kind"] == "train")
    assert all("muon_update_rms" in r for r in rows if r["kind"] == "train")  # Muon is the default optimizer
