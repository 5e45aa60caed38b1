#!/usr/bin/env bash
# Thin wrapper: see launch/build_wheelhouse.py --help.
exec "${PYTHON:-python3}" "$(dirname "$0")/build_wheelhouse.py" "$@"
