#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the CPU test suite (kernels under
# TRITON_INTERPRET=1). Extra arguments go to pytest, e.g. launch/test.sh tests/model -x
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/launch/setup_env.sh"
cd "$REPO"
exec .venv/bin/python -m pytest -n 2 --durations=15 "$@"
