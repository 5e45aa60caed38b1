"""Triton kernel tests on a machine without a GPU.

Triton runs kernels on CPU only through its interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before triton is imported. A test process that imported triton without
it marks the Triton tests skipped with ``triton_cpu`` and re-runs them in a subprocess that has it
(``rerun_under_interpreter``), so they never pass by being skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def interpreter_active() -> bool:
    try:
        import triton
    except ImportError:  # triton missing: the Triton tests fail loudly in the subprocess
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


TRITON_HERE = torch.cuda.is_available() or interpreter_active()
triton_cpu = pytest.mark.skipif(
    not TRITON_HERE,
    reason="Triton interpreter is off in this process (TRITON_INTERPRET=1 was not set before "
           "triton was imported); these run in a subprocess via test_triton_cpu_subprocess")
# For Triton tests on CPU tensors: they need the interpreter even where a GPU is (CI runs them).
triton_interpreter = pytest.mark.skipif(
    not interpreter_active(),
    reason="Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1 before triton is imported); "
           "the CPU test run has it")


def rerun_under_interpreter(test_file: str) -> None:
    """Run ``test_file``'s tests named *triton* (not the re-run itself) with the interpreter on."""
    if TRITON_HERE:
        pytest.skip("Triton tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file,
                        "-k", "triton and not subprocess"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.split("\n")[-2], r.stdout[-2000:]
