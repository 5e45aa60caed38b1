#!/usr/bin/env bash
# Create or update the k3train virtual environment. Idempotent: a second run is a no-op
# unless pyproject.toml (or the settings below) changed.
#
#   launch/setup_env.sh            # then: source .venv/bin/activate
#
# Environment variables (all optional):
#   VENV                venv folder                        (default: <repo>/.venv)
#   PYTHON              interpreter that creates the venv  (default: python3.11, else python3; needs >= 3.11)
#   K3_TORCH_SPEC       torch to install first when the venv has no torch (default: torch==2.13.0).
#                       Installing torch first stops pip from pulling a multi-GB CUDA build of a bare
#                       "torch" requirement on CPU machines.
#   K3_TORCH_INDEX_URL  extra index for that torch install, e.g. https://download.pytorch.org/whl/cpu
#   K3_EXTRAS           extras of k3train to install       (default: dev; empty for none)
#   K3_LOCK             pip constraints file: the tested versions (default: <repo>/requirements.lock;
#                       empty: the newest versions pyproject.toml allows)
#   K3_FORCE=1          reinstall even when the stamp matches
#   K3_DRY_RUN=1        print what would be done, change nothing
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
K3_TORCH_SPEC="${K3_TORCH_SPEC:-torch==2.13.0}"
K3_EXTRAS="${K3_EXTRAS-dev}"
K3_LOCK="${K3_LOCK-$REPO/requirements.lock}"
LOCK_ARGS=()
if [ -n "$K3_LOCK" ]; then
    if [ ! -f "$K3_LOCK" ]; then
        echo "setup_env: error: K3_LOCK=$K3_LOCK does not exist (K3_LOCK= installs without a lock)" >&2
        exit 2
    fi
    LOCK_ARGS=(-c "$K3_LOCK")
fi
STAMP="$VENV/.k3train-setup.stamp"

say() { echo "[setup_env] $*"; }
run() {
    say "+ $*"
    if [ "${K3_DRY_RUN:-0}" != 1 ]; then "$@"; fi
}

pick_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    for p in python3.11 python3.12 python3.13 python3; do
        if command -v "$p" >/dev/null 2>&1; then echo "$p"; return; fi
    done
    echo "setup_env: error: no python3 found; set PYTHON=/path/to/python3.11" >&2
    exit 2
}

# 1. The venv.
if [ ! -x "$VENV/bin/python" ]; then
    if [ -e "$VENV" ]; then
        echo "setup_env: error: $VENV exists but has no bin/python; remove it or set VENV" >&2
        exit 2
    fi
    PY="$(pick_python)"
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "setup_env: error: $PY is $("$PY" -V 2>&1); k3train needs Python >= 3.11 (set PYTHON)" >&2
        exit 2
    fi
    say "creating $VENV with $("$PY" -V 2>&1)"
    run "$PY" -m venv "$VENV"
else
    say "using existing $VENV ($("$VENV/bin/python" -V 2>&1))"
fi
VPY="$VENV/bin/python"

# 2. Skip when nothing changed (and the packages are still importable from outside the repo).
CHECK='import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("k3train", "torch", "megatron.core", "hydra")))'
HASH="$(cat "$REPO/pyproject.toml" ${K3_LOCK:+"$K3_LOCK"} | sha256sum | cut -c1-16)-${K3_EXTRAS}-${K3_TORCH_SPEC}"
if [ "${K3_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] \
        && (cd / && "$VPY" -c "$CHECK" >/dev/null 2>&1); then
    say "up to date (pyproject.toml and the lock unchanged since the last install; K3_FORCE=1 reinstalls)"
    exit 0
fi

# 3. torch first, only when the venv has none (keeps a GPU build someone installed on purpose).
if [ "${K3_DRY_RUN:-0}" != 1 ] && (cd / && "$VPY" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("torch"))' 2>/dev/null); then
    say "torch already installed: $(cd / && "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
else
    extra=()
    if [ -n "${K3_TORCH_INDEX_URL:-}" ]; then extra=(--extra-index-url "$K3_TORCH_INDEX_URL"); fi
    run "$VPY" -m pip install ${extra[@]+"${extra[@]}"} "$K3_TORCH_SPEC" ${LOCK_ARGS[@]+"${LOCK_ARGS[@]}"}
fi

# 4. k3train itself, editable, with its extras, at the locked versions.
if [ -n "$K3_EXTRAS" ]; then TARGET="$REPO[$K3_EXTRAS]"; else TARGET="$REPO"; fi
run "$VPY" -m pip install -e "$TARGET" ${LOCK_ARGS[@]+"${LOCK_ARGS[@]}"}

if [ "${K3_DRY_RUN:-0}" != 1 ]; then
    (cd / && "$VPY" -c "$CHECK") || { echo "setup_env: error: k3train, torch, megatron-core or hydra is not importable after the install" >&2; exit 1; }
    echo "$HASH" > "$STAMP"
    say "done; activate with: source $VENV/bin/activate"
fi
