#!/usr/bin/env bash
# The README's main job: set up (idempotent), then train k3_tiny on the embedded default corpus
# (the Python standard library's sources) on CPU. Extra arguments are Hydra overrides:
#   launch/train_tiny.sh train.steps=50 optim.lr=1e-3
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/launch/setup_env.sh"
cd "$REPO"
exec .venv/bin/python -m k3train.train model=k3_tiny train.device=cpu "$@"
