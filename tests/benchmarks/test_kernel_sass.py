"""benchmarks/kernel_sass.py compiles our kernels for sm_90 without a GPU (Triton's bundled ptxas and
cuobjdump), in a process of its own: the interpreter this test session runs under has no compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_situ_half_precision_path_is_shorter(tmp_path):
    """The SiTU kernels compile for sm_90, and the bf16 kernels (tanh without the fp32 series) issue
    fewer instructions an element than the fp32 ones, forward and backward."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "situ",
                    "--json", str(out)], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    rows = {(r["kernel"], r["dtype"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(k, d) for k in ("situ fwd", "situ bwd") for d in ("bf16", "fp32")}
    for kernel in ("situ fwd", "situ bwd"):
        half, full = rows[kernel, "bf16"], rows[kernel, "fp32"]
        assert 0 < half["instructions_per_element"] < 0.9 * full["instructions_per_element"], (half, full)
        assert half["registers"] > 0 and half["stack_bytes"] == 0
