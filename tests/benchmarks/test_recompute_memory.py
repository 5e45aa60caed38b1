"""benchmarks/recompute_memory.py end to end on CPU: k3_tiny, every policy, a table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_policy_keeps_less_and_the_json_says_so(tmp_path):
    out = tmp_path / "rm.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "recompute_memory.py"), "--model", "k3_tiny",
                           "--seq", "32", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "attn_res", "kda", "full"]
    kept = [r["saved_bytes"] for r in rows]
    assert kept[0] > kept[1] > kept[2] > kept[3] > 0, kept
    assert rows[0]["recomputed_modules"] == 0 and all(r["recomputed_modules"] > 0 for r in rows[1:])
    assert "full" in proc.stdout and "of none" in proc.stdout
