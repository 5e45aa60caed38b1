#!/usr/bin/env bash
# Single-node multi-process launch of the trainer (torchrun around `python -m k3train.train`).
#
#   NPROC=2 launch/torchrun.sh model=k3_tiny parallel.tensor=2 train.steps=50
#
# Arguments are passed to the trainer as Hydra overrides.
#
# Environment variables (all optional):
#   NPROC            processes on this node (default: number of visible GPUs, else 1)
#   MASTER_ADDR      rendezvous address (default: 127.0.0.1; with MASTER_PORT unset, torchrun
#                    --standalone picks a free port by itself)
#   MASTER_PORT      rendezvous port (set it to run two jobs side by side on fixed ports)
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NPROC, at least 1)
#   VENV             venv to use if it exists (default: <repo>/.venv); else PYTHON or python3
#   PYTHON           interpreter when there is no venv
#   K3_ENTRY         module to run (default: k3train.train)
#   K3_DRY_RUN=1     print the command instead of running it
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
if [ -x "$VENV/bin/python" ]; then PY="$VENV/bin/python"; else PY="${PYTHON:-python3}"; fi
K3_ENTRY="${K3_ENTRY:-k3train.train}"

if [ -z "${NPROC:-}" ]; then
    NPROC=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then n="$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)"; fi
        if [ "${n:-0}" -gt 0 ]; then NPROC="$n"; fi
    fi
fi
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: error: NPROC must be a positive integer, got '$NPROC'" >&2
    exit 2
fi
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores="$(nproc 2>/dev/null || echo 1)"
    OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
fi
export OMP_NUM_THREADS

if [ -n "${MASTER_PORT:-}" ]; then
    rdzv=(--nnodes 1 --node-rank 0 --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$MASTER_PORT")
else
    rdzv=(--standalone)
fi
cmd=("$PY" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$NPROC" -m "$K3_ENTRY" "$@")

echo "[torchrun.sh] NPROC=$NPROC OMP_NUM_THREADS=$OMP_NUM_THREADS: ${cmd[*]}" >&2
if [ "${K3_DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
# Relative paths in the overrides stay relative to the caller's folder; the repo goes on
# PYTHONPATH so that the trainer is importable even without an installed k3train.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "${cmd[@]}"
