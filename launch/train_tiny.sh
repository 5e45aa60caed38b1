#!/usr/bin/env bash
# The README's main job: set up (idempotent), then train k3_tiny on the embedded default corpus
# (the Python standard library's sources) on CPU. Extra arguments are Hydra overrides:
#   launch/train_tiny.sh train.steps=50 optim.lr=1e-3
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/launch/setup_env.sh"
cd "$REPO"
# K3's recipe at this size (docs/moe_notes.md §3): per-head Muon (the default optimizer), and Quantile
# Balancing updated after every micro-batch (the default), here of 2 sequences (8 a step), steering the
# step's running per-expert counts back to their share (step feedback 0.5, the default), plus once more at the
# end of the step from the router inputs re-scored by the updated router; this holds every layer's expert load
# max/mean near 1.1 from step 10 on (tests/training/test_expert_balance.py runs this line).
RECIPE=(train.micro_batch_size=2 model.qb_rescore_stride=1)
exec .venv/bin/python -m k3train.train model=k3_tiny train.device=cpu "${RECIPE[@]}" "$@"
